"""How scale groups are laid out: which groups exist, which are stacks of layers (a
scale per layer), and where each value sits in a :class:`GroupVector`.

A group is named by a plain string (a module path, ``""`` for the root). Layer ``i`` of
a stacked group ``g`` is the slot :class:`Layer` ``(g, i)``: a ``str`` that reads
``"g[i]"`` (so it prints, sorts and compares as it always has) but carries its group and
index as attributes, so nothing ever parses a name to learn that it is a layer. Every
piece of index arithmetic over slots (the runs a stack's layers are stored in, reading a
stack as one vector) lives here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp

from adaloss_jax import _tree


class Layer(str):
    """Layer ``index`` of the stacked group ``group``: the string ``"group[index]"``
    with its parts as attributes. ``index=None`` stands for every layer at once (the
    one region a scan's body holds for all of them), read ``"group[*]"``.

    >>> s = Layer("blocks", 3)
    >>> s, s.group, s.index, s == "blocks[3]"
    ('blocks[3]', 'blocks', 3, True)
    """

    __slots__ = ("group", "index")

    def __new__(cls, group: str, index: int | None):
        self = super().__new__(cls, f"{group}[{'*' if index is None else index}]")
        self.group, self.index = group, index
        return self

    def __getnewargs__(self):
        return (self.group, self.index)


def layers(group: str, n: int) -> list[Layer]:
    """The ``n`` slots of a stacked group, in order."""
    return [Layer(group, i) for i in range(n)]


def group_of(slot: str) -> str:
    """The group a slot belongs to: a layer's stack, else the slot itself."""
    return slot.group if isinstance(slot, Layer) else slot


def order(slots: Iterable[str]) -> list[str]:
    """Slots in model order (natural order of their names: ``g[2]`` before ``g[10]``)."""
    return sorted(slots, key=_tree.natural)


def check_names(slots: Sequence[str]) -> None:
    """Refuses a plain group named like one of the layers beside it (``"g[0]"`` next to a
    stack ``g``): the two would be one key."""
    layer_names = {str(s) for s in slots if isinstance(s, Layer)}
    clash = sorted(str(s) for s in slots if not isinstance(s, Layer) and s in layer_names)
    if clash:
        raise ValueError(
            f"scale groups {clash[:3]} are named like layers of a stacked group; rename "
            f"them (adaloss_jax.scale_group(name=...)) so no name ends in [<number>]")


def runs(slots: Sequence[str]) -> tuple[tuple[int, int, bool], ...]:
    """``(start, stop, stacked)`` per stored part: a stacked group's layers ``g[0]``,
    ``g[1]``, ... (consecutive, from 0) are one part, any other slot a part of its own."""
    out, i = [], 0
    while i < len(slots):
        j, first = i + 1, slots[i]
        stacked = isinstance(first, Layer) and first.index == 0
        if stacked:
            while (j < len(slots) and isinstance(slots[j], Layer)
                   and slots[j].group == first.group and slots[j].index == j - i):
                j += 1
        out.append((i, j, stacked))
        i = j
    return tuple(out)


class GroupVector(Mapping):
    """One value per scale group: ``v["Dense_0"]`` reads a group's value, iteration gives
    the group names (a read-only ``Mapping``) and ``v.array`` all values, the groups along
    the last axis. States stacked by ``vmap`` or ``shard_map`` (leading axes) read the
    same way.

    Attributes:
      names: the groups, in model order (static).
      parts: the values: one array (groups along its last axis), or one per group (the
        slots ``g[0]``, ``g[1]``, ... of a stacked group: one array of them).
      split: which of the two.

    A pytree whose leaves (``parts``) are the values, held as one array, or with
    ``split=True`` as one array per group. The scales are held split: the backward pass
    reads each group's scale on its own, and a value sliced out of a vector would make
    every kernel that reads it a kernel of its own (one per layer, each compiled); a
    stacked group's slots are read together, as one vector along a scan. The other
    fields are read all at once and held as one array (one output of the step).

    >>> v = GroupVector(("", "Dense_0"), jnp.array([3.0, 5.0]))
    >>> float(v["Dense_0"]), list(v)
    (5.0, ['', 'Dense_0'])
    >>> len(jax.tree_util.tree_leaves(GroupVector(v.names, v.array, split=True)))
    2
    """

    __slots__ = ("names", "parts", "split", "_runs")

    def __init__(self, names, array, *, split: bool = False):
        self.names = tuple(names)
        self.split = split
        self._runs = runs(self.names) if split else ()
        if split and isinstance(array, tuple | list) and len(array) == len(self.names):
            array = tuple(jnp.stack(array[a:b], axis=-1) if stacked else array[a]
                          for a, b, stacked in self._runs)
        elif split and not isinstance(array, tuple | list):
            array = tuple(array[..., a:b] if stacked else array[..., a]
                          for a, b, stacked in self._runs)
        self.parts = tuple(array) if split else array

    @property
    def array(self) -> jax.Array:
        """Every group's value, the groups along the last axis."""
        if not self.split:
            return self.parts
        return jnp.concatenate([p if stacked else p[..., None]
                                for p, (_, _, stacked) in zip(self.parts, self._runs)],
                               axis=-1)

    def index(self, name: str) -> int:
        """The position of group ``name`` along the last axis."""
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(name) from None

    def stacked(self, group: str) -> jax.Array:
        """The slots ``group[0]``, ``group[1]``, ... as one array (along the last axis)."""
        i = self.index(Layer(group, 0))
        if self.split:
            for p, (a, _, stacked) in zip(self.parts, self._runs):
                if a == i and stacked:
                    return p
        n = sum(1 for g in self.names if isinstance(g, Layer) and g.group == group)
        return self.array[..., i:i + n]

    def __getitem__(self, name):
        i = self.index(name)
        if not self.split:
            return self.parts[..., i]
        for p, (a, b, stacked) in zip(self.parts, self._runs):
            if a <= i < b:
                return p[..., i - a] if stacked else p
        raise KeyError(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __repr__(self):
        return f"GroupVector(names={self.names!r}, array={self.array!r})"


def _flatten(v):
    if v.split:
        keys = [v.names[a].group + "[:]" if stacked else str(v.names[a])
                for a, _, stacked in v._runs]
        return tuple((jax.tree_util.DictKey(k), x) for k, x in zip(keys, v.parts)), (
            v.names, True)
    return ((jax.tree_util.GetAttrKey("array"), v.parts),), (v.names, False)


jax.tree_util.register_pytree_with_keys(
    GroupVector, _flatten,
    lambda aux, children: GroupVector(aux[0], tuple(children) if aux[1] else children[0],
                                      split=aux[1]),
    flatten_func=lambda v: ((v.parts if v.split else (v.parts,)), (v.names, v.split)),
)
