"""How a per-request state page (Mamba conv and SSM state, gated delta net) is cut across TP ranks.

Part of the layout layer, below ``spec`` (whose ``Buffer.state`` carries it) and above nothing. A state page
is not cut by attention heads but by *channels*, in sections sharded independently: Mamba2's conv state is
``[x | B | C]`` over channels (x sharded by heads; B and C by groups, or the same groups on every rank when
the groups do not divide by the TP size), GDN's is ``[q | k | v]``, an SSM state ``[heads, head_dim,
d_state]`` one section of heads. A conv state stored window-major (``[kernel-1, channels]``) repeats its
sections once per window row.

A ``StateSection`` is ``repeats`` rows, ``stride`` bytes apart, from byte ``offset`` of the page; each row
holds this rank's ``channels`` channels of ``channel_bytes`` bytes. A *sharded* section holds channels
``[r * channels, (r+1) * channels)`` of the model's ``channels x tp_size`` on rank ``r``; a replicated one
holds the same channels on every rank. Offsets and strides are this rank's; what must match across TP
sizes is each section's rows, bytes per channel and model-wide channels (``model_key``). Bytes outside
every section (padding) are never moved across TP sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvferry.errors import LayoutError

__all__ = ["StateGeometry", "StateSection", "mamba2_conv_sections"]

MAX_SECTIONS = 1 << 12
MAX_SECTION_ROWS = 1 << 16      # section rows over all sections: what the overlap check expands
_MAX_BYTES = 1 << 40


def _check_int(where: str, what: str, value: object, lower: int, upper: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{where}: {what} must be an int, got {type(value).__name__} {value!r}")
    if not lower <= value <= upper:
        raise LayoutError(f"{where}: {what} must be in {lower}..{upper}, got {value}")


@dataclass(frozen=True, slots=True)
class StateSection:
    """``repeats`` rows of ``channels x channel_bytes`` bytes, the first at ``offset``, ``stride`` apart."""

    offset: int
    channels: int
    channel_bytes: int
    repeats: int = 1
    stride: int = 0
    sharded: bool = True

    def __post_init__(self) -> None:
        where = "state section"
        _check_int(where, "offset", self.offset, 0, _MAX_BYTES)
        _check_int(where, "channels", self.channels, 1, 1 << 30)
        _check_int(where, "channel_bytes", self.channel_bytes, 1, _MAX_BYTES)
        _check_int(where, "repeats", self.repeats, 1, MAX_SECTION_ROWS)
        _check_int(where, "stride", self.stride, 0, _MAX_BYTES)
        if not isinstance(self.sharded, bool):
            raise LayoutError(f"{where}: sharded must be a bool, got {self.sharded!r}")
        if self.repeats > 1 and self.stride < self.row_bytes:
            raise LayoutError(f"{where}: stride {self.stride} is shorter than a row of {self.channels} channels x "
                              f"{self.channel_bytes} B = {self.row_bytes}: its rows would overlap")

    @property
    def row_bytes(self) -> int:
        return self.channels * self.channel_bytes

    @property
    def end(self) -> int:
        """One past the section's last byte in the page."""
        return self.offset + (self.repeats - 1) * self.stride + self.row_bytes

    def total_channels(self, tp_size: int) -> int:
        """The model's channels in this section: this rank's times ``tp_size`` when sharded."""
        return self.channels * tp_size if self.sharded else self.channels

    def model_key(self, tp_size: int) -> tuple[int, int, int]:
        return (self.repeats, self.channel_bytes, self.total_channels(tp_size))


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """A state page's sections, in declaration order (the order a slice's bytes are digested in)."""

    sections: tuple[StateSection, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.sections, tuple) or not self.sections:
            raise LayoutError("state geometry: sections must be a non-empty tuple")
        if len(self.sections) > MAX_SECTIONS:
            raise LayoutError(f"state geometry: {len(self.sections)} sections, more than {MAX_SECTIONS}")
        for s in self.sections:
            if not isinstance(s, StateSection):
                raise LayoutError(f"state geometry: expected StateSection, got {type(s).__name__}")
        rows = sum(s.repeats for s in self.sections)
        if rows > MAX_SECTION_ROWS:
            raise LayoutError(f"state geometry: {rows} section rows, more than {MAX_SECTION_ROWS}")
        self._check_disjoint()

    def _check_disjoint(self) -> None:
        """No byte in two sections (or two rows of one): each byte then has exactly one source."""
        reps = np.array([s.repeats for s in self.sections], dtype=np.int64)
        sec = np.repeat(np.arange(len(self.sections)), reps)
        row = np.arange(len(sec)) - np.repeat(np.cumsum(reps) - reps, reps)
        off = np.array([s.offset for s in self.sections], dtype=np.int64)[sec]
        stride = np.array([s.stride for s in self.sections], dtype=np.int64)[sec]
        start = off + row * stride
        end = start + np.array([s.row_bytes for s in self.sections], dtype=np.int64)[sec]
        order = np.argsort(start, kind="stable")
        clash = np.flatnonzero(start[order][1:] < end[order][:-1])
        if clash.size:
            a, b = int(sec[order][clash[0]]), int(sec[order][clash[0] + 1])
            raise LayoutError(f"state geometry: sections {a} and {b} overlap (a row of section {a} ends at byte "
                              f"{int(end[order][clash[0]])}, one of section {b} starts at "
                              f"{int(start[order][clash[0] + 1])})")

    @property
    def extent(self) -> int:
        """One past the last byte any section covers (the page may be padded beyond it)."""
        return max(s.end for s in self.sections)

    @property
    def nbytes(self) -> int:
        """Bytes the sections cover on this rank."""
        return sum(s.repeats * s.row_bytes for s in self.sections)

    def key(self) -> tuple[object, ...]:
        return tuple((s.offset, s.channels, s.channel_bytes, s.repeats, s.stride, s.sharded) for s in self.sections)

    def model_key(self, tp_size: int) -> tuple[object, ...]:
        """What must match across TP sizes of one model: per section its rows, bytes per channel and model-wide
        channels (offsets, strides and padding are each rank's own)."""
        return tuple(s.model_key(tp_size) for s in self.sections)

    # -- packed layouts ----------------------------------------------------------------------------------
    @classmethod
    def packed(cls, parts: Sequence[tuple[int, Sequence[tuple[int, int, bool]]]], offset: int = 0) -> StateGeometry:
        """Sections laid out back to back: ``parts`` is a list of ``(repeats, [(channels, channel_bytes,
        sharded), ...])``, each part ``repeats`` rows of its sections, one part after the other.

        Mamba2 conv state ``[conv_dim, kernel-1]`` is one part of one row, ``[(x, (k-1)*e, True), (B, ...),
        (C, ...)]``; stored ``[kernel-1, conv_dim]`` it is ``k-1`` rows of ``[(x, e, True), ...]``; an SSM
        state after it is a second part, ``(1, [(heads, head_dim*d_state*e, True)])``."""
        sections, at = [], offset
        for repeats, secs in parts:
            row = sum(c * b for c, b, _ in secs)
            pos = at
            for channels, channel_bytes, sharded in secs:
                sections.append(StateSection(pos, channels, channel_bytes, repeats, row if repeats > 1 else 0,
                                             sharded))
                pos += channels * channel_bytes
            at += repeats * row
        return cls(tuple(sections))

    def parts(self) -> list[tuple[int, list[tuple[int, int, bool]]]]:
        """The inverse of ``packed`` (with ``offset`` 0); ``LayoutError`` when the sections are not packed."""
        parts: list[tuple[int, list[tuple[int, int, bool]]]] = []
        row_end = -1   # where the current part's row ends so far: a section starting there joins it
        for s in self.sections:
            if not (parts and parts[-1][0] == s.repeats and s.offset == row_end):
                parts.append((s.repeats, []))
            parts[-1][1].append((s.channels, s.channel_bytes, s.sharded))
            row_end = s.offset + s.row_bytes
        if StateGeometry.packed(parts) != self:
            raise LayoutError("state geometry: sections are not packed back to back from byte 0 (each part's rows "
                              "one after another); only packed sections can be resharded")
        return parts

    def resharded(self, tp_size: int) -> StateGeometry:
        """This (``tp_size`` 1) geometry as one rank of ``tp_size`` holds it: sharded sections keep
        ``channels / tp_size`` channels, packed again. ``LayoutError`` naming the section when a count does
        not divide."""
        parts, i = [], 0
        for repeats, secs in self.parts():
            out = []
            for channels, channel_bytes, sharded in secs:
                if sharded and channels % tp_size:
                    raise LayoutError(f"state section {i}: {channels} channels do not divide evenly over tp_size "
                                      f"{tp_size}")
                out.append((channels // tp_size if sharded else channels, channel_bytes, sharded))
                i += 1
            parts.append((repeats, out))
        return StateGeometry.packed(parts)


def mamba2_conv_sections(channels: int, n_groups: int, d_state: int, tp_size: int,
                         channel_bytes: int) -> list[tuple[int, int, bool]] | None:
    """One rank's Mamba2 conv channels ``[x | B | C]`` as ``packed`` sections ``(channels, channel_bytes,
    sharded)``, from its ``channels`` (x and both group blocks) and the model's ``n_groups`` and ``d_state``.

    x is sharded by heads. B and C are ``n_groups x d_state`` channels each: sharded when the groups divide
    over the ranks; with one group, the same group on every rank (both engines' ``extra_groups_for_head_shards``
    extend one group to one per rank), replicated. None for any other split (several groups over more
    ranks: each group on some ranks only, which a section cannot say) or when no x channel is left."""
    if n_groups <= 0 or d_state <= 0 or tp_size <= 0:
        return None
    if n_groups % tp_size == 0:
        groups, sharded = n_groups // tp_size, True
    elif n_groups == 1:
        groups, sharded = 1, False
    else:
        return None
    x = channels - 2 * groups * d_state
    if x <= 0:
        return None
    return [(x, channel_bytes, True), (groups * d_state, channel_bytes, sharded),
            (groups * d_state, channel_bytes, sharded)]
