"""Read the scalars of a TensorBoard run directory (``events.out.tfevents.*``) as ``metrics.csv``-like rows.

Lightning's default logger is TensorBoard when ``tensorboard`` is installed (the ``app`` extra
installs it), so ``lightning_logs/version_0`` of a plain ``Trainer`` run holds event files, not a
``metrics.csv``. ``tensorboard`` is imported only when such a directory is read.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Optional, Union

__all__ = ["EVENTS_GLOB", "TensorBoardMissing", "Truncated", "find_truncated", "has_events", "read_scalars"]


#: How TensorBoard names its event files.
EVENTS_GLOB = "events.out.tfevents.*"


class TensorBoardMissing(ImportError):
    """The run logged to TensorBoard, and the ``tensorboard`` package is not installed."""


@dataclasses.dataclass(frozen=True)
class Truncated:
    """An event file that ends inside a record: the run was cut (killed, disk full) or is still writing."""

    path: Path
    #: The last step of a scalar in the file's complete records (None: no scalar before the cut).
    last_step: Optional[int]
    #: Where the last complete record ends, and the file's size.
    complete_bytes: int
    size: int

    def describe(self) -> str:
        read = f"after step {self.last_step}" if self.last_step is not None else "before its first scalar"
        return (f"{self.path} is truncated {read}: it ends inside a record (its complete records end at byte "
                f"{self.complete_bytes:,} of {self.size:,}); the run was cut, or is still writing")


#: A TFRecord: an 8-byte length and its 4-byte CRC, the data, and the data's 4-byte CRC.
_HEADER, _FOOTER = 12, 4


def find_truncated(directory: Union[str, Path]) -> list[Truncated]:
    """The event files in ``directory`` that end inside a record (TensorBoard's reader stops there silently).

    Walks each file's record framing; the steps come from the complete records' events.

    Raises:
        TensorBoardMissing: ``tensorboard`` is not installed (it parses the events).
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError as err:
        raise _missing(directory) from err
    found = []
    for path in sorted(Path(directory).glob(EVENTS_GLOB)):
        size = path.stat().st_size
        offset, last_step = 0, None
        # Record by record (an event file can hold images and histograms: never all of it in memory).
        with open(path, "rb") as file:
            while offset < size:
                header = file.read(_HEADER)
                if len(header) < _HEADER:
                    break
                length = struct.unpack_from("<Q", header)[0]
                if offset + _HEADER + length + _FOOTER > size:
                    break
                try:
                    event = Event.FromString(file.read(length))
                except Exception:  # noqa: BLE001  (a damaged record: the file holds nothing readable after it)
                    break
                file.seek(_FOOTER, 1)
                if event.HasField("summary") and len(event.summary.value):
                    last_step = int(event.step) if last_step is None else max(last_step, int(event.step))
                offset += _HEADER + length + _FOOTER
        if offset < size:
            found.append(Truncated(path, last_step, offset, size))
    return found


def has_events(directory: Union[str, Path]) -> bool:
    """Does ``directory`` itself hold TensorBoard event files?"""
    return Path(directory).is_dir() and any(Path(directory).glob(EVENTS_GLOB))


def read_scalars(directory: Union[str, Path]) -> list[dict[str, float]]:
    """Every scalar of the event files in ``directory``, as rows like ``metrics.csv``'s.

    Each row holds ``step`` and the values logged at that step; a tag logged twice at the same
    step (a validation and the end of training, say) starts a second row for that step, as
    ``CSVLogger`` writes one row per ``log_metrics`` call. Rows are in step order.

    Raises:
        TensorBoardMissing: ``tensorboard`` is not installed.
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise _missing(directory) from err
    # size_guidance 0: every event, not TensorBoard's default sample of 10,000 per tag.
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    events = [
        (event.step, event.wall_time, tag, float(event.value))
        for tag in accumulator.Tags().get("scalars", [])
        for event in accumulator.Scalars(tag)
    ]
    rows_at: dict[int, list[dict[str, float]]] = {}
    for step, _, tag, value in sorted(events, key=lambda e: (e[0], e[1])):
        rows = rows_at.setdefault(step, [])
        row = next((r for r in rows if tag not in r), None)
        if row is None:
            row = {"step": float(step)}
            rows.append(row)
        row[tag] = value
    return [row for step in sorted(rows_at) for row in rows_at[step]]


def _missing(directory: Union[str, Path]) -> TensorBoardMissing:
    return TensorBoardMissing(
        f"{directory} holds TensorBoard event files; reading them needs tensorboard "
        "(pip install tensorboard, or pip install 'lightning-pin[app]')"
    )
