"""What every pin kind is: :class:`Kind`, the interface the rest of the library calls.

A kind is one class (one module of :mod:`lightning_pin.core.kinds`). Its class methods say what
the kind means wherever a pin of it goes: which :class:`~lightning_pin.Pin` fields it reads and
their checks (at construction), how those fields resolve on a parameter into a per-element
payload, the summary's words, its conflicts with other pins on one element. Its saved form (the
pin state, a stored tensor in a checkpoint or an export, a fault map, a forced fault) is read
through one generic protocol written here from the kind's data. An
instance is the restore kernel of one parameter's elements under active pins of the kind: a
*projection* onto the set the pins allow (:meth:`Kind.kernel`, sync-free), with :meth:`Kind.drift`
and :meth:`Kind.off` for the monitor, ``verify()`` and, through the saved form, stored tensors.

Nothing here imports the plan, the engine or Lightning: ``lightning-pin check`` / ``diff``
(:mod:`lightning_pin.reporting`) ask the kinds about stored tensors too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from lightning_pin.core.errors import PinError
from lightning_pin.core.kinds._common import merge_rounds
from lightning_pin.core.selection import SavedSelection, Selection
from lightning_pin.core.sharding import Target, copy_at, wide_index
from lightning_pin.core.spec import Pin

__all__ = ["Expected", "HOOKS", "Kind", "Reader", "Unreadable", "pin_field", "read_field", "show"]


#: ``read(field, source)``: ``source`` (a Pin field) for the parameter being resolved: a file it
#: names is loaded, a dict by parameter name gives this parameter's entry (see the plan).
Reader = Callable[[str, Any], Any]
#: ``expected(position)``: what element ``position`` of a comparison must hold (a number, or words).
Expected = Callable[[int], "float | str"]


#: What a kind implements, 12 methods (it may leave out those with a default: check_spec,
#: check_fits, check_overlap, check_saved, map_entries, map_pin). Everything else a kind is asked
#: (``apply``, the saved form, ``check`` / ``diff`` on stored tensors, forced faults, fault-map
#: merging, messages) is implemented once in :class:`Kind` from its data (class attributes).
HOOKS = (
    # the spec and the plan
    "check_spec", "resolve", "describe", "check_fits", "check_overlap", "merge",
    # the saved form: refusing a payload no spec gives, fault-map files
    "check_saved", "map_entries", "map_pin",
    # the kernel (an instance): the restore with its constants bound, the monitor's drift, what breaks the pin
    "kernel", "drift", "off",
)


def pin_field(pin: Pin, field: str) -> Any:
    """``pin``'s field ``field``: an argument of :class:`~lightning_pin.Pin`, or an entry of its
    ``kind_args`` for a kind registered outside the library (None: not given)."""
    if field in type(pin).__dataclass_fields__:
        return getattr(pin, field)
    return (pin.kind_args or {}).get(field)


class Unreadable(Exception):
    """A stored tensor in which a kind cannot be checked (its words are of another width)."""

    def __init__(self, what: str, word: str) -> None:
        super().__init__(f"{what} of {word}")
        #: What cannot be read ("stuck bits"), and what it needs ("a 32-bit word").
        self.what, self.word = what, word


class Kind:
    """One kind of pin: what it means everywhere (class methods) and its restore kernel (instances).

    What a kind implements is at most these methods (:data:`HOOKS`); everything else a kind is
    asked (its saved form in the pin state, how ``check`` / ``diff`` read a stored tensor, its
    fault-map entries, the words a forced fault writes, messages) is generic, implemented once
    here from the kind's data (class attributes such as :attr:`payload_fields` and
    :attr:`map_fields`) and those methods:

    - the spec: :meth:`check_spec` (its :attr:`pin_fields` at construction);
    - the plan: :meth:`resolve` (the fields on one parameter, into ``selection.payload``),
      :meth:`describe`, :meth:`check_fits`, :meth:`check_overlap`;
    - the kernel: :meth:`merge` (the selections of one parameter under the active pins into an
      instance), then :meth:`kernel` (the restore of a tensor as one call with its constants bound:
      the step plan runs it after every optimizer step; :meth:`apply` is it built and run once),
      :meth:`drift` and :meth:`off`;
    - the saved form: ``selection.payload`` itself (see :meth:`saved`), refused where no spec of
      the kind can give it by :meth:`check_saved`. Everything that reads it goes through one
      protocol: :meth:`from_saved` (the kernel merged from saved selections, on a stand-in of the
      stored elements), :meth:`stored_off` (its :meth:`off` on a stored tensor: ``check``,
      ``diff``), :meth:`stored_bind` (what it reads beside the tensor) and :meth:`word_rewrite`
      (its :meth:`apply` on the stored words: a forced fault, a bit flip);
    - fault-map files: :meth:`map_entries` and :meth:`map_pin` (by default the :attr:`map_fields` of
      the payload); how two pins' entries merge and what cannot hold together follow :attr:`map_fold`.

    An instance holds a :class:`~lightning_pin.core.sharding.Target`: the merged elements of one
    parameter and a per-element payload, so the kernels are index based, sync-free and work on
    dense, permuted and sharded tensors alike through :meth:`Target.part`.
    """

    #: The kind's name: in the pin state, :attr:`Pin.kind` and selections (``"value"``, ``"bounds"``).
    kind: ClassVar[str]
    #: The kind in a sentence about two pins: "a value", "stuck bits", "bounds".
    words: ClassVar[str]
    #: What elements that break it are, in ``verify()``: "off target", "out of bounds".
    off_words: ClassVar[str]
    #: One element in a violation, formatted with ``coords``, ``actual`` and ``expected``.
    example: ClassVar[str] = "{coords}: {actual!r} ({expected})"
    #: The :class:`~lightning_pin.Pin` fields the kind reads: a pin giving any of them is of this kind.
    pin_fields: ClassVar[tuple[str, ...]] = ()
    #: Names of the tensors a resolved selection holds (``Selection.payload``, the saved
    #: ``SavedSelection.payload``), in the order they are fingerprinted and saved: one entry per
    #: element, except those in :attr:`selection_fields`.
    payload_fields: ClassVar[tuple[str, ...]] = ()
    #: The payload fields that hold one tensor per selection, not one entry per element.
    selection_fields: ClassVar[tuple[str, ...]] = ()
    #: Payload fields a stored artifact holds beside the weight, by the payload field naming it
    #: (UTF-8 bytes): a learned scale, read by ``check`` / ``diff`` from the artifact's own tensors.
    named_fields: ClassVar[dict[str, str]] = {}
    #: The payload field whose dtype is the parameter's (None: the saved form does not tell it).
    dtype_field: ClassVar[Optional[str]] = None
    #: What a saved payload field belongs to, in the message of a mismatch ("" names the parameter alone).
    saved_owner: ClassVar[str] = ""
    #: How ``check`` / ``diff`` word what a stored element must hold, from the words of :meth:`off`
    #: (``"bounds {expected}"``); numbers (a value's target) are left as numbers.
    stored_example: ClassVar[str] = "{expected}"
    #: Why ``verify`` cannot read the kind in a copy of another dtype: "its stuck bits are bits of"
    #: (the parameter's dtype follows); "" reads any copy.
    copy_words: ClassVar[str] = ""
    #: True for the kind whose elements are frozen: their gradients are masked, their optimizer
    #: statistics zeroed, their targets merged with those of other such pins (and captured for
    #: ``value=None``), and the saved form is the target (``SavedSelection.target``) rather than a
    #: payload. Other kinds leave gradients and statistics alone: their elements train.
    frozen: ClassVar[bool] = False
    #: Whether the kind fixes the stored words of its elements (a value, stuck bits): a forced fault
    #: writes what :meth:`apply` writes. An interval leaves the element free inside it.
    fixes_words: ClassVar[bool] = True
    #: Why this kind and another cannot share an element, when this kind is the reason (the
    #: first kind of the registry with a reason gives it).
    mixed_reason: ClassVar[str] = ""

    # Fault-map files (lightning_pin.faults.fault_map): one entry per element and field.
    #: The kind's fields in a fault-map file, and the entry that marks a healthy element in each.
    map_fields: ClassVar[dict[str, float]] = {}
    #: Whether the map fields hold integer bit patterns (else numbers, read as float64).
    map_bits: ClassVar[bool] = False
    #: Whether a merged map field keeps the dtype of the pins' entries (widened to hold them all)
    #: rather than int64 (bit patterns) or float64.
    map_keeps_dtype: ClassVar[bool] = False
    #: How two pins' entries for one element merge, per map field: ``"or"`` (bit patterns),
    #: ``"max"`` / ``"min"`` (bounds intersect) or ``"same"`` (two different entries are an error).
    map_fold: ClassVar[dict[str, str]] = {}
    #: The kind's per-parameter entries in a fault-map file (``name:<field>``, not one per element:
    #: a quantized code's spec and scales).
    map_spec_fields: ClassVar[tuple[str, ...]] = ()
    #: What two ``"or"`` map fields hold, in a message: "bits", "code bits".
    bit_words: ClassVar[str] = "bits"
    #: ``count`` elements of the kind in a map's summary line, singular and plural: "3 stuck values".
    map_words: ClassVar[tuple[str, str]] = ("", "")

    # ------------------------------------------------------------------------------------
    # The spec (no model)

    @classmethod
    def check_spec(cls, pin: Pin) -> None:
        """Refuse, with a :class:`~lightning_pin.PinError`, what is wrong in the kind's fields
        without a model (forms, ranges, fields of other kinds on the same pin)."""

    # ------------------------------------------------------------------------------------
    # The plan (one parameter)

    @classmethod
    def resolve(
        cls, pin: Pin, selection: Selection, read: Reader, warn: Callable[[str], Any], module: torch.nn.Module
    ) -> None:
        """Resolve the kind's fields on ``selection``'s parameter (of ``module``, the module being
        pinned): sort and dedupe ``selection.index`` and set its per-element payload (in the sorted
        order). A kind whose fields name other tensors of the module (a quantized code's learned
        scale) keeps them in ``selection.context`` (read at every restore; never saved or
        fingerprinted).

        Raises:
            PinError: what the parameter cannot honour.
        """
        raise NotImplementedError

    @classmethod
    def describe(cls, selection: Selection) -> str:
        """The summary's words for what the selection holds ("explicit values", "bounds [0, 1]")."""
        raise NotImplementedError

    @classmethod
    def check_fits(cls, pin: Pin, name: str, selection: Selection, dtype: torch.dtype) -> None:
        """Check that ``selection`` still holds once its floating parameter is cast to ``dtype``."""

    @classmethod
    def check_overlap(cls, first: Pin, a: Selection, second: Pin, b: Selection, name: str) -> None:
        """Two pins of this kind on one parameter at overlapping steps: refuse what cannot hold together."""

    @classmethod
    def merge(
        cls, name: str, parameter: torch.nn.Parameter, entries: Sequence[Selection],
        captured: Sequence[Optional[Tensor]] = (),
    ) -> Optional[Kind]:
        """One kernel for the selections ``entries`` of one parameter, in pin order (runs when the
        set of active pins changes; it may sync). ``captured``: per entry, what its pin captured when
        it activated (the frozen kind's ``value=None`` targets), else None. None: nothing to hold yet."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------
    # The saved form: the pin state (lightning_pin.core.state), check / diff on stored tensors

    @classmethod
    def check_saved(cls, payload: Mapping[str, Tensor], at: str, corrupt: Callable[[str], Exception]) -> None:
        """Refuse a saved payload no spec of the kind can give."""

    # ------------------------------------------------------------------------------------
    # Fault-map files (lightning_pin.faults.fault_map): one entry per element and field

    @classmethod
    def map_entries(cls, pin: Pin, selection: Optional[Selection]) -> dict[str, Any]:
        """``pin``'s entries by map field: with ``selection`` (the pin resolved on a module) one per
        selected element, on the CPU; without, the pin's own fields, to save it without a module
        (``None``: not given). Entries of :attr:`map_spec_fields` are per parameter (a code's spec).

        Raises:
            PinError: the pin cannot be saved without a module.
        """
        if selection is None:
            return {field: pin_field(pin, field) for field in cls.map_fields}
        entries = {}
        for field in cls.map_fields:
            tensor = selection.payload[field].detach().cpu().reshape(-1)
            if cls.map_bits and tensor.dtype in (torch.int16, torch.int32):
                # Bit masks are held in the signed integer of the word's width: the map stores the unsigned pattern.
                tensor = tensor.to(torch.int64) & ((1 << (8 * tensor.element_size())) - 1)
            elif cls.map_bits or not cls.map_keeps_dtype:
                tensor = tensor.to(torch.int64 if cls.map_bits else torch.float64)
            entries[field] = tensor
        return entries

    @classmethod
    def map_pin(
        cls, pattern: str, fields: Mapping[str, Tensor], marked: Tensor, select: dict[str, Any],
        spec: Mapping[str, Tensor], where: str,
    ) -> Pin:
        """The pin for the ``marked`` elements of a map (``select``: the selection fields; ``spec``:
        the parameter's entries of :attr:`map_spec_fields`).

        Raises:
            PinError: per-parameter entries no saved pin gives, naming ``where``.
        """
        given = {f: fields[f][marked] for f in cls.map_fields if f in fields}
        own = {f: v for f, v in given.items() if f not in Pin.__dataclass_fields__}  # a registered kind's
        extra = {"kind_args": own} if own else {}
        return Pin(pattern, **{f: v for f, v in given.items() if f not in own}, **extra, **select)

    # ====================================================================================
    # Generic: implemented once, from the kind's data and the methods above (not overridden)

    @classmethod
    def claims(cls, pin: Pin) -> bool:
        """Whether ``pin`` is of this kind: it gives one of the kind's fields."""
        return any(pin_field(pin, field) is not None for field in cls.pin_fields)

    @classmethod
    def saved(cls, selection: Selection, captured: Optional[Tensor]) -> SavedSelection:
        """What the pin state saves of ``selection``: its payload, or for the frozen kind its target
        (explicit, or ``captured`` when the pin activated)."""
        if cls.frozen:
            explicit = selection.values is not None
            return SavedSelection(selection.index, selection.values if explicit else captured, explicit, cls.kind)
        payload = {field: selection.payload[field].cpu() for field in cls.payload_fields}
        return SavedSelection(selection.index, None, True, cls.kind, payload=payload)

    @classmethod
    def read_saved(
        cls, index: Optional[Tensor], target: Any, explicit: bool, saved: Mapping[str, Any], at: str,
        corrupt: Callable[[str], Exception],
    ) -> SavedSelection:
        """Read one saved selection of this kind (``index``, ``target`` and ``explicit`` are checked).

        Raises:
            CorruptPinState: through ``corrupt``, naming ``at`` and what is wrong.
        """
        if cls.frozen:
            if target is None and explicit:
                raise corrupt(f"{at}: an explicit pin without a target")
            return SavedSelection(index, target, explicit, cls.kind)
        if target is not None or not explicit:
            raise corrupt(f"{at}: a {cls.kind} selection holds no target and is explicit (it comes from the spec)")
        shape = None if index is None else (index.numel(),)
        payload = {
            field: read_field(saved, field, at, None if field in cls.selection_fields else shape, corrupt)
            for field in cls.payload_fields
        }
        cls.check_saved(payload, at, corrupt)
        return SavedSelection(index, None, True, cls.kind, payload=payload)

    @classmethod
    def saved_differs(cls, selection: Selection, saved: SavedSelection, name: str) -> list[str]:
        """Why ``saved`` (same elements, same kind) is not what ``selection`` holds now, if it is not."""
        if cls.frozen:
            return _target_differs(selection, saved, name)
        problems = []
        for field in cls.payload_fields:
            mine, theirs = selection.payload[field].cpu(), saved.payload[field]
            if theirs.dtype != mine.dtype or not torch.equal(theirs, mine):
                problems.append(f"the saved {field} of {cls.saved_owner}{name!r} differ from the spec's")
        return problems

    @classmethod
    def stored_off(cls, values: Tensor, saved: SavedSelection | Sequence[SavedSelection]) -> tuple[Tensor, Expected]:
        """``(off, expected)`` for a stored tensor (a checkpoint's, an export's): which elements of
        ``values`` (flat) break the saved selection, and what element ``i`` of them must hold (a
        number, or words: :attr:`stored_example`). ``values`` holds the stored elements of one
        selection (in the selection's order), or the whole stored tensor for several selections of
        one parameter, merged as the engine merges them (an explicit value beats a captured one).
        It is :meth:`off` of the kernel merged from the saved form, :meth:`from_saved`.

        Raises:
            Unreadable: the stored tensor cannot be checked for this kind (a word of another width).
            IndexError: selections outside the stored tensor (an index past its end, a whole-tensor
                payload of another size).
        """
        flat = values.detach().reshape(-1)
        kernel = cls.from_saved(saved, flat)
        _, off, expected = kernel.off(flat)
        if cls.stored_example != "{expected}":
            words = expected

            def expected(i: int) -> float | str:
                said = words(i)
                return cls.stored_example.format(expected=said) if isinstance(said, str) else said

        index = kernel.target.index
        if index is None:
            return off, expected
        index = index.long()
        every = torch.zeros(flat.numel(), dtype=torch.bool, device=off.device)
        every[index] = off
        by_position = expected
        return every, lambda i: by_position(int(torch.searchsorted(index, i)))

    @classmethod
    def from_saved(cls, saved: SavedSelection | Sequence[SavedSelection], values: Tensor) -> Kind:
        """The kernel of a saved selection on its stored elements ``values`` (flat, in the
        selection's order), or of several saved selections of one parameter on the whole stored
        tensor ``values`` (read flat; the kernel's ``target.index`` says where its elements are):
        merged as the engine merges them, on a stand-in parameter of those elements in their
        stored dtype (what :meth:`stored_off` reads).

        Raises:
            Unreadable: a selection that holds no target (a ``value=None`` pin never activated).
            IndexError: selections outside ``values`` (several selections only).
        """
        flat = values.detach().reshape(-1)
        one = isinstance(saved, SavedSelection)
        selections = [saved] if one else list(saved)
        stand_in = torch.nn.Parameter(torch.empty_like(flat), requires_grad=False)
        entries, captured = [], []
        for selection in selections:
            payload = {
                field: tensor if field in cls.selection_fields else tensor.reshape(-1)
                for field, tensor in selection.payload.items()
            }
            target = None if selection.target is None else selection.target.reshape(-1)
            index = None if one else selection.index
            if not one:
                _check_fits_stored(selection, target, payload, cls.selection_fields, flat.numel())
            # What merge reads of a selection (a Selection of the plan, which the kinds do not import).
            entries.append(_Stored(stand_in, index, target if selection.explicit else None, cls.kind, payload))
            captured.append(None if selection.explicit else target)
        kernel = cls.merge("stored", stand_in, entries, captured)
        if kernel is None:
            raise Unreadable(cls.words, "a target")
        return kernel

    @classmethod
    def stored_bind(cls, saved: SavedSelection, tensors: Mapping[str, Tensor]) -> SavedSelection:
        """``saved`` with its :attr:`named_fields` read from the stored artifact's other tensors (by
        name), before :meth:`stored_off` (a quantized code's learned scale is stored beside its weight;
        unbound, :meth:`off` raises :class:`Unreadable`)."""
        payload = dict(saved.payload)
        for field, name_field in cls.named_fields.items():
            name = bytes(payload[name_field].tolist()).decode()
            if name and name in tensors:
                payload[field] = tensors[name].detach().reshape(-1)
        if all(payload[field] is saved.payload[field] for field in cls.named_fields):
            return saved
        return SavedSelection(saved.index, saved.target, saved.explicit, cls.kind, payload=payload)

    @classmethod
    def stored_dtype(cls, saved: SavedSelection) -> Optional[torch.dtype]:
        """The parameter's dtype, if the saved selection tells it (stuck-bit masks do not)."""
        if cls.frozen:
            return None if saved.target is None else saved.target.dtype
        return None if cls.dtype_field is None else saved.payload[cls.dtype_field].dtype

    @classmethod
    def word_rewrite(
        cls, selection: Selection, word: torch.dtype, count: int
    ) -> Optional[Callable[[Tensor], Tensor]]:
        """``rewrite(old_words) -> new_words`` for the ``count`` selected elements, as integer words
        of dtype ``word``: the stored words once the fault is forced, what :meth:`apply` writes;
        None when the kind fixes no word (:attr:`fixes_words`) or holds no target yet."""
        if not cls.fixes_words:
            return None
        dtype = selection.parameter.dtype
        stand_in = torch.nn.Parameter(
            torch.empty(count, dtype=dtype, device=selection.parameter.device), requires_grad=False
        )
        flat = dataclasses.replace(
            selection, parameter=stand_in, index=None,
            values=None if selection.values is None else selection.values.reshape(-1),
            payload={f: t if f in cls.selection_fields else t.reshape(-1) for f, t in selection.payload.items()},
        )
        kernel = cls.merge(selection.name, stand_in, [flat], [None])
        if kernel is None:
            return None  # captured when the pin activates: no word yet

        def rewrite(old: Tensor) -> Tensor:
            values = old.view(dtype).clone()
            kernel.apply(values)
            return values.view(old.dtype)

        return rewrite

    @classmethod
    def map_check(cls, merged: Mapping[str, Tensor], element: Callable[[int], str]) -> None:
        """Refuse merged map entries that cannot hold together (``element(row)``: its words): bits
        of the two ``"or"`` fields (stuck at zero, stuck at one) stuck both ways, or a ``"max"``
        field (a lower bound) above its ``"min"`` field.

        Raises:
            PinError: naming the first such element.
        """
        folds = {fold: field for field, fold in cls.map_fold.items() if field in merged}
        ors = [field for field, fold in cls.map_fold.items() if fold == "or" and field in merged]
        if len(ors) == 2:
            zero, one = merged[ors[0]], merged[ors[1]]
            if bool((zero & one).any()):
                at = int((zero & one).ne(0).to(torch.int8).argmax())
                raise PinError(f"save_fault_map: {element(at)} has {cls.bit_words} {int(zero[at] & one[at]):#x} stuck "
                               "at zero and at one")
        if "max" in folds and "min" in folds:
            low, high = merged[folds["max"]], merged[folds["min"]]
            if bool((low > high).any()):
                at = int((low > high).to(torch.int8).argmax())
                raise PinError(f"save_fault_map: the {cls.words} of {element(at)} do not overlap "
                               f"({low[at].item()} > {high[at].item()})")

    @classmethod
    def show_example(cls, coords: tuple[int, ...], actual: Any, expected: Any) -> str:
        """One element in a violation: ``(0, 1): 2.0 (bounds [0, 1])`` (see :attr:`example`)."""
        return cls.example.format(coords=coords, actual=actual, expected=expected)

    @classmethod
    def map_summary(cls, count: int) -> str:
        """``count`` elements of the kind in a map's summary line: "3 stuck values", "2 bounded"."""
        return f"{count:,} {cls.map_words[0] if count == 1 else cls.map_words[1]}"

    @classmethod
    def map_marked(cls, fields: Mapping[str, Tensor]) -> Optional[Tensor]:
        """Which elements the map's entries mark faulty for this kind (None: the map has none of its fields)."""
        marked = None
        for field, healthy in cls.map_fields.items():
            tensor = fields.get(field)
            if tensor is not None:
                faulty = ~tensor.isnan() if math.isnan(healthy) else tensor != healthy
                marked = faulty if marked is None else marked | faulty
        return marked

    @classmethod
    def map_dtype(cls, field: str, given: Sequence[Tensor]) -> torch.dtype:
        """The dtype of a merged map field, from the entries of the pins on one parameter."""
        if cls.map_keeps_dtype:
            return functools.reduce(torch.promote_types, [t.dtype for t in given])
        return torch.int64 if cls.map_bits else torch.float64

    @classmethod
    def map_merge(cls, where: Callable[[int], str], field: str, target: Tensor, at: Tensor, given: Tensor) -> None:
        """Merge one pin's entries ``given`` into ``target`` at rows ``at`` (``at`` may repeat a row)
        as :attr:`map_fold` says.

        Raises:
            PinError: two different entries for one element of a ``"same"`` field, naming the
                element (``where(row)``: its words).
        """
        fold = cls.map_fold.get(field, "same")
        if fold in ("max", "min"):
            target.scatter_reduce_(0, at, given, reduce="a" + fold)
        elif fold == "or":
            merge_rounds(target, at, given, lambda rows, before, entries: before | entries)
        else:
            healthy = cls.map_fields[field]

            def agree(rows: Tensor, before: Tensor, entries: Tensor) -> Tensor:
                unset = before.isnan() if math.isnan(healthy) else before == healthy
                clash = ~unset & (before != entries)
                if bool(clash.any()):
                    raise PinError(
                        f"save_fault_map: {where(int(rows[clash.to(torch.int8).argmax()]))} is given two different "
                        f"{cls.map_words[1]}"
                    )
                return entries

            merge_rounds(target, at, given, agree)

    # ------------------------------------------------------------------------------------
    # The restore kernel (an instance: one parameter's elements under the active pins)

    def __init__(self, target: Target) -> None:
        self.target = target
        self._split: dict[tuple[int, torch.device, torch.dtype], tuple[Tensor, Tensor, Tensor]] = {}
        self._scratch: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    @property
    def name(self) -> str:
        """The parameter's name."""
        return self.target.name

    @property
    def elements(self) -> int:
        """How many elements the kernel holds (from shapes only: no sync)."""
        index = self.target.index
        return self.target.parameter.numel() if index is None else index.numel()

    def kernel(self, tensor: Tensor) -> Callable[[], None]:
        """The projection of ``tensor`` (the parameter's data, or a copy of the weights) in place, as
        one call with every constant bound (positions, payload halves in ``tensor``'s dtype, scratch).
        Built when the active pins change (it may sync) and run after every optimizer step while they
        stay the same; whoever keeps it builds it again once ``tensor``'s storage moves (a ``.data``
        swap). Its tensor ops are the kind's restore: nothing else is called per step."""
        raise NotImplementedError

    def apply(self, tensor: Tensor) -> None:
        """Project ``tensor`` in place once: :meth:`kernel` built and run."""
        self.kernel(tensor)()

    def gather(
        self, tensor: Tensor, words: Optional[torch.dtype] = None
    ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Callable[..., Any]]]:
        """``(view, payload, index, scratch, put)`` for a :meth:`kernel` on ``tensor``: :meth:`Target.part`
        (``view`` read as ``words``, an integer dtype of the same width, if given) and, for element pins,
        what gathers them into ``scratch`` and writes them back: ``torch.index_select(view, 0, index,
        out=scratch)`` then ``put(0, index, scratch)`` (``view.index_copy_``: no Python frame). For a
        whole tensor ``index``, ``scratch`` and ``put`` are None. The scratch is kept per dtype and
        device, so a kernel built again (``apply``) allocates nothing in steady state."""
        view, positions, payload = self.target.part(tensor)
        if words is not None:
            view = view.view(words)  # the same bytes: no copy, no rounding
        if positions is None:
            return view, payload, None, None, None
        positions = positions.to(view.device)
        key = (view.dtype, view.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() != positions.numel():
            scratch = self._scratch[key] = torch.empty(positions.numel(), dtype=view.dtype, device=view.device)
        wide = wide_index(positions)
        if wide is None:  # too many elements to keep a second index: widened a chunk at a time
            return view, payload, positions, scratch, functools.partial(_put_chunked, view)
        return view, payload, wide, scratch, view.index_copy_

    def drift(self, tensor: Tensor) -> Tensor:
        """``|x - P(x)|`` of the elements, flat, in float32 or wider (0 where they hold)."""
        raise NotImplementedError

    def off(self, tensor: Tensor) -> tuple[Tensor, Tensor, Expected]:
        """``(actual, off, expected)``: the elements of ``tensor`` (flat), where they break the
        pin, and ``expected(position)``: what element ``position`` must hold (a target value, or
        in words the stuck bits or the interval). Nothing is kept once the result is dropped."""
        raise NotImplementedError

    def refuse_copy(self, tensor: Tensor) -> Optional[str]:
        """Why ``verify`` cannot check this kind on ``tensor`` (a copy in another dtype), or None
        (see :attr:`copy_words`)."""
        dtype = self.target.parameter.dtype
        if self.copy_words and tensor.dtype != dtype:
            return (f"verify: {self.name!r} is {tensor.dtype} here but {self.copy_words} {dtype}; verify a copy in "
                    "the parameter's dtype")
        return None

    def elements_of(self, tensor: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
        """``(view, positions, payload, actual)``: :meth:`Target.part` plus the elements, flat."""
        view, positions, payload = self.target.part(tensor)
        actual = view.reshape(-1) if positions is None else view.index_select(0, positions)
        return view, positions, payload, actual

    def _halves(self, payload: Tensor, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The two halves of a paired payload (last dimension 2), contiguous, on ``device``.

        Split once per payload (a shard has its own) and device, then reused at every step.
        """
        key = (id(payload), device, dtype)
        cached = self._split.get(key)
        if cached is None or cached[0] is not payload:
            first, second = (payload[..., i].contiguous().to(device=device, dtype=dtype) for i in (0, 1))
            cached = self._split[key] = (payload, first, second)
        return cached[1], cached[2]


class _Stored:
    """A saved selection as :meth:`Kind.merge` reads a selection (see :meth:`Kind.from_saved`)."""

    name, how = "stored", "saved"

    def __init__(self, parameter: torch.nn.Parameter, index: Optional[Tensor], values: Optional[Tensor], kind: str,
                 payload: dict[str, Tensor]) -> None:
        self.parameter, self.index, self.values, self.kind, self.payload = parameter, index, values, kind, payload
        self.context: dict[str, Any] = {}


def _check_fits_stored(
    selection: SavedSelection, target: Optional[Tensor], payload: Mapping[str, Tensor], per_selection: Sequence[str],
    numel: int,
) -> None:
    """Refuse, with an IndexError, a saved selection that does not lie inside a stored tensor of ``numel`` elements."""
    index = selection.index
    if index is None:
        count = target.numel() if target is not None else next(
            (t.numel() for f, t in payload.items() if f not in per_selection), numel)
        if count != numel:
            raise IndexError(f"{count} targets for {numel} elements")
    elif index.numel() and int(index.max()) >= numel:
        raise IndexError(f"index {int(index.max())} for {numel} elements")


def _put_chunked(flat: Tensor, dim: int, positions: Tensor, values: Tensor) -> None:
    """``put`` of :meth:`Kind.gather` for int32 positions too many to widen at once (see ``copy_at``)."""
    copy_at(flat, positions, values)


def _target_differs(selection: Selection, saved: SavedSelection, name: str) -> list[str]:
    """Why the frozen kind's saved target is not what ``selection`` holds now, if it is not."""
    index, target = saved.index, saved.target
    if target is None:
        return []
    if tuple(target.shape) != (tuple(selection.parameter.shape) if index is None else (index.numel(),)):
        return [f"the saved targets of {name!r} have shape {tuple(target.shape)}"]
    stored = target.to(selection.parameter.dtype)
    if not torch.equal(stored.to(target.dtype), target):
        return [f"the saved targets of {name!r} do not fit {selection.parameter.dtype}"]
    if selection.values is not None and not torch.equal(stored, selection.values.cpu()):
        return [f"the explicit values for {name!r} differ from the saved ones"]
    return []


def read_field(
    saved: Mapping[str, Any], key: str, at: str, shape: Optional[tuple[int, ...]], corrupt: Callable[[str], Exception]
) -> Tensor:
    """A per-element tensor of a saved selection, checked to be a tensor with one entry per index."""
    value = saved.get(key)
    if not isinstance(value, Tensor):
        raise corrupt(f"{at}: {key!r} must be a tensor, got {show(value)}")
    if shape is not None and tuple(value.shape) != shape:
        raise corrupt(f"{at}: {shape[0]} indices but {key!r} of shape {tuple(value.shape)}")
    return value


def show(value: Any) -> str:
    """A value in a corrupt-state message: tensors by dtype and shape, others clipped."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
