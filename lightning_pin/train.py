"""``python -m lightning_pin.train [overrides]``: the Hydra app (:mod:`lightning_pin.app.train`)."""

from lightning_pin.app.train import main

if __name__ == "__main__":
    main()
