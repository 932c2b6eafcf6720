from slimml.cli import main

main()
