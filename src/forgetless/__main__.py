from forgetless.cli import main

main()
