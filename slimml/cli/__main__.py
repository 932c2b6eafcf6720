from slimml.cli.entry import main

main()
