"""``python -m lightning_pin.train [overrides]``: the Hydra app (:mod:`lightning_pin.app.train`)."""

import importlib.util
import sys
from collections.abc import Sequence

from lightning_pin.app.train import main

__all__ = ["SWEEPER", "refuse_missing_sweeper"]


#: What ``hparams_search=optuna`` needs, and what ``make`` installs instead (optuna >= 3 for ``lightning-pin tune``).
SWEEPER = "hydra_plugins.hydra_optuna_sweeper"


def refuse_missing_sweeper(argv: Sequence[str]) -> None:
    """Exit 2 with one line when ``hparams_search=optuna`` is asked for without Hydra's Optuna sweeper.

    The plugin pins optuna < 3, so it cannot sit beside the ``tune`` extra that ``make`` installs;
    Hydra's own message ("Could not find 'hydra/sweeper/optuna'") names neither the cause nor the fix.
    """
    asked = any(arg.lstrip("+~").split("=", 1) == ["hparams_search", "optuna"] for arg in argv)
    if asked and importlib.util.find_spec(SWEEPER.split(".")[0]) is not None:
        asked = importlib.util.find_spec(SWEEPER) is None
    if asked:
        print("lightning-pin train: error: hparams_search=optuna needs Hydra's Optuna sweeper plugin, which is not "
              "installed (pip install 'lightning-pin[optuna-sweeper]' pins optuna<3, beside which the [tune] extra "
              "cannot sit): search with `lightning-pin tune` instead, e.g. lightning-pin tune --trials 12 "
              "--param optimizer.lr=log:3e-4:3e-2 --param pin.fraction=float:0.01:0.3", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    refuse_missing_sweeper(sys.argv[1:])
    main()
