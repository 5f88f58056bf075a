from weightship.cli import main

main()
