"""A strict checker of the subgroup streams a MoQT draft-18 peer sends, written from the draft and not from
kvnet's own codec (proto/), so that it cannot share a misreading with the code under test.

It reads the raw bytes of every unidirectional stream the peer opened toward us and how each one ended
(FIN, reset with its code, or still open) and holds them against what the original publisher published.
The rules, with the sections of draft-ietf-moq-transport-18 they come from:

- "Subgroup Header": the stream Type is 0b0XX1XXXX with SUBGROUP_ID_MODE not 0b11; the header's fields
  follow its bits; a Track Alias the subscription owns.
- "Subgroup Header" (objects) and "Object Status": Object ID = previous + delta + 1; the status field only
  for an empty payload, one of Normal, End of Group, End of Track; nothing after End of Group/Track.
- "Subgroups": objects of one subgroup are never sent on different streams unless a stream was reset
  (every stream of a subgroup but the last one opened ended with a reset).
- "Closing Subgroup Streams": a stream that ended with FIN carries every object of its subgroup from the
  subscription's Start Location on (a stream closed before that must be reset); a relay forwards an
  object on an existing stream only if it is the next one of the subgroup; a FIN arrives after whole
  objects only.
- "Subgroup Header" bits: END_OF_GROUP with FIN means no larger Object ID exists in the group;
  FIRST_OBJECT set means the stream's first object is the first the publisher sent in the subgroup, and
  ("Subgroups") a relay forwarding a subgroup from its first object MUST set it (checked where the
  original publisher set it, since only then can a relay know).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

NORMAL, END_OF_GROUP, END_OF_TRACK = 0x0, 0x3, 0x4
STATUSES = (NORMAL, END_OF_GROUP, END_OF_TRACK)


class Incomplete(Exception):
    """The bytes end inside a field."""


def read_vi64(data: bytes, pos: int) -> tuple[int, int]:
    """Draft "Variable-Length Integers": the count of leading 1 bits of the first byte gives the length
    (0 -> 1 byte ... 8 -> 9 bytes); the bits after the first 0 and the following bytes are the value."""
    if pos >= len(data):
        raise Incomplete
    first = data[pos]
    ones = 0
    while ones < 8 and first & (0x80 >> ones):
        ones += 1
    length = ones + 1
    if pos + length > len(data):
        raise Incomplete
    value = first & (0xFF >> (ones + 1)) if ones < 8 else 0
    for b in data[pos + 1 : pos + length]:
        value = (value << 8) | b
    return value, pos + length


@dataclass
class RecordedStream:
    """One unidirectional stream the peer opened: its bytes and how it ended."""

    stream_id: int
    data: bytearray = field(default_factory=bytearray)
    fin: bool = False
    reset_code: int | None = None

    @property
    def ended(self) -> bool:
        return self.fin or self.reset_code is not None


class StreamRecorder:
    """Records the peer-opened unidirectional streams of one QUIC connection from its stack's events
    (``StreamDataReceived``: stream_id, data, end_stream; ``StreamReset``: stream_id, error_code)."""

    def __init__(self) -> None:
        self.streams: dict[int, RecordedStream] = {}

    def record(self, event: Any) -> None:
        kind = type(event).__name__
        if kind not in ("StreamDataReceived", "StreamReset") or event.stream_id % 4 != 3:
            return  # only server-initiated unidirectional streams (RFC 9000 section 2.1)
        rec = self.streams.setdefault(event.stream_id, RecordedStream(event.stream_id))
        if kind == "StreamDataReceived":
            rec.data += event.data
            rec.fin = rec.fin or bool(event.end_stream)
        elif not rec.fin:  # "If the application receives all data on the stream and the FIN, it can
            rec.reset_code = int(event.error_code)  # ignore any subsequent reset."

    def subgroup_streams(self) -> list[SubgroupStream]:
        """Every recorded stream that is a subgroup stream (the rest: SETUP, FETCH), parsed so far."""
        out = []
        for rec in sorted(self.streams.values(), key=lambda r: r.stream_id):
            parsed = parse_subgroup_stream(rec)
            if parsed is not None:
                out.append(parsed)
        return out

    def objects_received(self) -> int:
        return sum(len(s.objects) for s in self.subgroup_streams())


@dataclass
class SubgroupObject:
    object_id: int
    status: int
    payload: bytes


@dataclass
class SubgroupStream:
    """A subgroup stream as read from its bytes."""

    rec: RecordedStream
    stream_type: int
    track_alias: int
    group: int
    subgroup: int | None
    """None: SUBGROUP_ID_MODE 0b01 and no object yet."""
    end_of_group: bool
    first_object: bool
    objects: list[SubgroupObject]
    errors: list[str]
    trailing: int
    """Bytes after the last whole object (a partial object)."""

    @property
    def key(self) -> tuple[int, int | None]:
        return self.group, self.subgroup


def is_subgroup_type(t: int) -> bool:
    return t & 0b1001_0000 == 0b0001_0000 and t < 0x80


def parse_subgroup_stream(rec: RecordedStream) -> SubgroupStream | None:
    """The stream's header and whole objects; None if it is no subgroup stream (or too short to tell)."""
    data = bytes(rec.data)
    try:
        stream_type, pos = read_vi64(data, 0)
    except Incomplete:
        return None
    if not is_subgroup_type(stream_type):
        return None
    errors: list[str] = []
    mode = (stream_type & 0x06) >> 1
    if mode == 0b11:
        errors.append(f"stream {rec.stream_id}: type {stream_type:#x} has the reserved SUBGROUP_ID_MODE 0b11")
    try:
        alias, pos = read_vi64(data, pos)
        group, pos = read_vi64(data, pos)
        subgroup: int | None = 0 if mode == 0b00 else None
        if mode == 0b10:
            subgroup, pos = read_vi64(data, pos)
        if not stream_type & 0x20:
            if pos >= len(data):
                raise Incomplete
            pos += 1  # Publisher Priority (8)
    except Incomplete:
        return None
    objects: list[SubgroupObject] = []
    prev: int | None = None
    while pos < len(data):
        start = pos
        try:
            delta, pos = read_vi64(data, pos)
            if stream_type & 0x01:
                props_len, pos = read_vi64(data, pos)
                pos += props_len
                if pos > len(data):
                    raise Incomplete
            length, pos = read_vi64(data, pos)
            status = NORMAL
            if length == 0:
                status, pos = read_vi64(data, pos)
            if pos + length > len(data):
                raise Incomplete
        except Incomplete:
            pos = start
            break
        object_id = delta if prev is None else prev + delta + 1
        prev = object_id
        if status not in STATUSES:
            errors.append(f"stream {rec.stream_id}: object {object_id} has unknown status {status:#x}")
        if objects and objects[-1].status in (END_OF_GROUP, END_OF_TRACK):
            errors.append(f"stream {rec.stream_id}: object {object_id} follows an End of Group/Track object")
        objects.append(SubgroupObject(object_id, status, data[pos : pos + length]))
        pos += length
        if mode == 0b01 and subgroup is None:
            subgroup = object_id
    return SubgroupStream(
        rec, stream_type, alias, group, subgroup, bool(stream_type & 0x08), bool(stream_type & 0x40), objects,
        errors, len(data) - pos,
    )  # fmt: skip


Published = dict[tuple[int, int], list[tuple[int, int, bytes]]]
"""(group, subgroup) -> the original publisher's objects of that subgroup in order: (object id, status,
payload); the whole subgroup as the publisher made it, also objects it never got to send."""


def check_subgroup_streams(
    streams: list[SubgroupStream],
    track_alias: int,
    published: Published,
    start: tuple[int, int] = (0, 0),
    publisher_sets_first_object: bool = False,
) -> list[str]:
    """Every breach of the draft's subgroup rules in ``streams`` (all of one subscription), given what
    the original publisher ``published`` and the subscription's Start Location; empty when none."""
    errors: list[str] = []
    by_subgroup: dict[tuple[int, int | None], list[SubgroupStream]] = {}
    for s in streams:
        sid = s.rec.stream_id
        errors += s.errors
        if s.track_alias != track_alias:
            errors.append(f"stream {sid}: Track Alias {s.track_alias}, the subscription's is {track_alias}")
            continue
        if s.rec.fin and s.trailing:
            errors.append(f"stream {sid}: FIN inside an object ({s.trailing} bytes of a partial object)")
        if not s.rec.ended:
            errors.append(f"stream {sid}: never closed (neither FIN nor reset)")
        by_subgroup.setdefault(s.key, []).append(s)
        if s.subgroup is None:
            continue
        truth = published.get((s.group, s.subgroup))
        if truth is None:
            errors.append(f"stream {sid}: subgroup {s.key} was never published")
            continue
        ids = [o[0] for o in truth]
        by_id = {o[0]: o for o in truth}
        for obj in s.objects:
            want = by_id.get(obj.object_id)
            if want is None or (want[1], want[2]) != (obj.status, obj.payload):
                errors.append(f"stream {sid}: object {s.key}/{obj.object_id} differs from the publisher's")
        # A relay forwards an object on an existing stream only if it is the subgroup's next one.
        sent = [o.object_id for o in s.objects if o.object_id in by_id]
        for a, b in itertools.pairwise(sent):
            if ids.index(b) != ids.index(a) + 1:
                errors.append(f"stream {sid}: object {b} of {s.key} follows {a}, skipping the ones between")
        wanted = [i for i in ids if (s.group, i) >= start]
        if s.rec.fin and sent != wanted:
            errors.append(
                f"stream {sid}: FIN for subgroup {s.key} carrying objects {sent}, the subgroup has {wanted}"
                " (an incomplete subgroup stream must be reset)"
            )
        if s.rec.fin and s.end_of_group and s.objects:
            largest = max(o[0] for (g, _), objs in published.items() if g == s.group for o in objs)
            if s.objects[-1].object_id != largest:
                errors.append(f"stream {sid}: END_OF_GROUP and FIN, but group {s.group} goes on to {largest}")
        starts_subgroup = bool(s.objects) and s.objects[0].object_id == ids[0]
        if s.objects and s.first_object and not starts_subgroup:
            errors.append(f"stream {sid}: FIRST_OBJECT set, but its first object is not the subgroup's first")
        if publisher_sets_first_object and starts_subgroup and not s.first_object:
            errors.append(f"stream {sid}: {s.key} forwarded from its first object without FIRST_OBJECT")
    for key, group_streams in by_subgroup.items():
        for s in group_streams[:-1]:
            if s.rec.reset_code is None:
                later = [t.rec.stream_id for t in group_streams if t.rec.stream_id > s.rec.stream_id]
                errors.append(
                    f"subgroup {key}: sent on streams {s.rec.stream_id} and {later}, and stream "
                    f"{s.rec.stream_id} was not reset"
                )
    return errors

