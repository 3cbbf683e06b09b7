from sandgate.cli.main import main

main()
