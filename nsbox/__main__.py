from nsbox._fastcli import main

main()
