from reservations.cli import main

main()
