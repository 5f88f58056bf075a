"""`python -m weightship_dev` is `weightship-dev`."""

from weightship_dev.cli import main

if __name__ == "__main__":
    main()
