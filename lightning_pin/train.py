"""``python -m lightning_pin.train [overrides]``: the Hydra app (:mod:`lightning_pin.app.train`)."""

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

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


#: Hydra's flags after which the overrides are not one config to compose (a sweep, help, another config): not checked.
_UNCHECKED = {"-m", "--multirun", "-h", "--help", "--hydra-help", "-i", "--info", "-c", "--cfg", "--resolve", "-p",
              "--package", "-sc", "--shell-completion", "--version", "-cn", "--config-name", "-cp", "--config-path",
              "--experimental-rerun"}


def refuse_unknown_keys(argv: Sequence[str]) -> None:
    """Exit 2 with one line when an override names no key of the config (``trainer.max_epoch=1``), naming the
    closest valid keys (``trainer.max_epochs``), instead of Hydra's seven-line dump of the config node.

    The overrides are composed once as Hydra will compose them (with ``--config-dir``); any other error is left
    to Hydra to report as it does.
    """
    if any(arg.split("=", 1)[0] in _UNCHECKED for arg in argv):
        return
    config_dir, overrides, args = None, [], iter(argv)
    for arg in args:
        if arg in ("-cd", "--config-dir"):
            config_dir = next(args, None)
        elif arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return  # a flag this check does not know: Hydra reads it
        else:
            overrides.append(arg)
    if not overrides:
        return
    from lightning_pin.app.compose import compose_app, unknown_key

    try:
        compose_app(overrides, Path.cwd() / "outputs", config_dir=config_dir)
    except Exception as err:  # noqa: BLE001  (only an unknown key is reported here; Hydra reports the rest)
        message = unknown_key(err)
        if message is not None:
            print(f"lightning-pin train: error: {message}", file=sys.stderr)
            sys.exit(2)


if __name__ == "__main__":
    refuse_missing_sweeper(sys.argv[1:])
    refuse_unknown_keys(sys.argv[1:])
    main()
