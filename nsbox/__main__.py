from nsbox.cli.fast import main

main()
