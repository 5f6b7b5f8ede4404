from nsbox.cli import main

main()
