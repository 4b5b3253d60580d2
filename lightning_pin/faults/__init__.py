"""Fault models as ordinary pins: stuck-at cells, stuck bits, and fault-map files.

A faulty accelerator holds some weights whatever training writes. These generators draw such
faults for a module and return plain :class:`~lightning_pin.Pin` lists, to give to
:class:`~lightning_pin.PinCallback` or :func:`~lightning_pin.pin`:

- :func:`cell_faults`: a ``rate`` fraction of the elements is stuck: SA0 cells read ``0.0``, SA1
  cells read ``sign(w) * high`` (a ReRAM device stuck at its extreme conductance);
- :func:`bit_faults`: each (element, bit) pair of the stored word is stuck with probability
  ``rate`` (a bit error rate of SRAM / DRAM weight memory); the other bits keep training;
- :func:`flip_bits`: transient flips: each (element, bit) pair flips with probability ``rate``
  while a ``with`` block evaluates the model, and the words are restored exactly on exit;
- :func:`quantize`: the forward reads each weight's dequantized integer code (quantization-aware
  training); with ``bit_faults(..., code=QuantCode(...))`` the stuck bits are bits of those codes;
- :func:`neuron_faults`: a ``rate`` fraction of the channels (or output positions) of chosen
  modules stuck at 0, at saturation or at seeded values in every forward (:class:`~lightning_pin.NeuronPin`);
- :func:`remap`: fault-aware mapping: permute hidden units (function kept) so the faults damage the
  weights least, before retraining (:class:`FaultMapping` undoes, saves and re-applies it);
- :func:`save_fault_map` / :func:`load_fault_map`: one file format for stuck values, stuck bits
  and bounds per parameter name, so a chip's measured fault map can be pinned as it is.

On a model quantized by torchao (``quantize_(model, Int8WeightOnlyConfig())``), ``bit_faults``,
``cell_faults``, ``flip_bits`` and ``forced_patch`` act on the stored int8 codes (``qdata``, bits
0-7), never the scales (:mod:`lightning_pin.faults.int8`).

Every draw is seeded with ``seed`` and the parameter's name and made on the CPU in full-parameter
coordinates: the same faults on every rank, run and resume. Torch only (no Lightning).
"""

from lightning_pin.faults._common import FaultPins
from lightning_pin.faults.bits import bit_faults, bit_positions
from lightning_pin.faults.cells import cell_faults
from lightning_pin.faults.fault_map import load_fault_map, save_fault_map
from lightning_pin.faults.flips import BitFlips, WordPatch, changed_bits, flip_bits, forced_patch
from lightning_pin.faults.quantize import QuantizeHandle, quantize, quantize_codes
from lightning_pin.faults.neurons import neuron_faults
from lightning_pin.faults.remap import FaultMapping, remap
from lightning_pin.faults.remap_spec import remap_spec

__all__ = [
    "BitFlips",
    "FaultMapping",
    "FaultPins",
    "QuantizeHandle",
    "WordPatch",
    "bit_faults",
    "bit_positions",
    "cell_faults",
    "changed_bits",
    "flip_bits",
    "forced_patch",
    "load_fault_map",
    "quantize",
    "quantize_codes",
    "remap",
    "remap_spec",
    "neuron_faults",
    "save_fault_map",
]
