"""The layout layer: what KV memory holds (buffers, pools, layouts), where it is (``KVMemory``), presets.

Above ``errors``, ``arrays`` and ``codec``; below ``plan``. Inside, bottom to top: ``manifest`` (wire
structs), ``state`` (how a state page is cut across TP ranks), ``spec`` (``Buffer``, ``Pool``, ``Layout``),
``compare`` (first difference between two layouts),
``memory`` (the binding of buffers to addresses), ``presets`` (six model families).
"""

from kvferry.layout.compare import model_difference, shape_difference, tp_compatible
from kvferry.layout.manifest import MANIFEST_VERSION
from kvferry.layout.memory import KVMemory, PoolArrays, Region
from kvferry.layout.spec import Buffer, HeadGeometry, Layout, Pool
from kvferry.layout.state import StateGeometry, StateSection

__all__ = ["MANIFEST_VERSION", "Buffer", "HeadGeometry", "KVMemory", "Layout", "Pool", "PoolArrays", "Region",
           "StateGeometry", "StateSection", "model_difference", "shape_difference", "tp_compatible"]
