"""Task ownership of weights for continual learning (PackNet and kin), with torch only.

:class:`TaskOwnership` keeps an owner per element of the chosen parameters (0 = free, task ids
from 1) and turns it into :class:`~lightning_pin.Pin`\\ s: while task ``t`` trains, every element an
earlier task owns is pinned at its value, so the engine holds it bit for bit under any optimizer,
weight decay, clipping, accumulation, mixed precision and resume, and learning task ``t`` cannot
change tasks ``1..t-1`` at all (backward transfer exactly zero). The same pins work with both doors:
``PinCallback(own.pins(t))`` in a ``Trainer`` and ``pin(model, optimizer, own.pins(t))`` in a plain
loop. Moving to the next task keeps the optimizer, its parameter groups and its scheduler: a new
set of pins activates and zeroes the optimizer statistics of the elements it newly holds.

The life of a task ``t``::

    own.pins(t)            # start t: train with these pins (earlier tasks held)
    own.prune(t, 0.5)      # optional: zero t's smallest half, which stays free for later tasks
    own.pins(t)            # fine-tune t: its kept elements train, the pruned ones stay at 0
    own.commit(t)          # t owns what it kept; its normalization layers are snapshotted
    with own.view(t): ...  # evaluate t: later tasks' and free elements read 0, restored on exit

:class:`AccuracyMatrix` records the accuracy matrix, average accuracy, backward transfer and the
fingerprints after each task; :func:`lightning_pin.reporting.continual.write_continual_report`
writes them as JSON and draws the heat map.

The package keeps each part in its room: :mod:`~lightning_pin.tasks.ownership` (the owner map
and what a task does to it), :mod:`~lightning_pin.tasks.saved` (its saved form),
:mod:`~lightning_pin.tasks.inspection` (capacity, fingerprints, the summary line) and
:mod:`~lightning_pin.tasks.accuracy` (the accuracy matrix).
"""

from lightning_pin.tasks.accuracy import AccuracyMatrix
from lightning_pin.tasks.ownership import TaskOwnership

__all__ = ["AccuracyMatrix", "TaskOwnership"]
