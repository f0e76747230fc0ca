"""Golden vectors written by hand from the draft-18 figures, checked in both directions."""

from __future__ import annotations

import pytest

from proto.buffer import Buffer, vi64_encode
from proto.data import (
    DataStreamItem,
    DataStreamReader,
    FetchEndOfRange,
    FetchHeader,
    FetchObject,
    FetchObjectEncoder,
    StreamEnd,
    SubgroupHeader,
    SubgroupIdMode,
    SubgroupObject,
    encode_fetch_header,
    encode_subgroup_header,
    encode_subgroup_object,
)
from proto.messages import (
    ControlMessage,
    ControlMessageReader,
    FilterType,
    KeyValuePair,
    MessageParameters,
    Setup,
    Subscribe,
    SubscriptionFilter,
    encode_message,
)


def h(text: str) -> bytes:
    """Hex with spaces and '#' comments to the end of each line."""
    return bytes.fromhex("".join(line.split("#")[0] for line in text.splitlines()))


# -- vi64 boundaries (section "Variable-Length Integers": leading 1 bits give the length) --------

VI64_GOLDEN = [
    (127, "7f"),  # 0 + 7 value bits
    (128, "80 80"),  # leading 10: +1 byte
    (16383, "bf ff"),
    (16384, "c0 40 00"),  # leading 110: +2 bytes
    (2097151, "df ff ff"),
    (2097152, "e0 20 00 00"),  # leading 1110: +3
    (268435455, "ef ff ff ff"),
    (268435456, "f0 10 00 00 00"),  # leading 11110: +4
    (2**35 - 1, "f7 ff ff ff ff"),
    (2**35, "f8 08 00 00 00 00"),  # 111110xx +5
    (2**42 - 1, "fb ff ff ff ff ff"),
    (2**42, "fc 04 00 00 00 00 00"),  # 1111110x +6
    (2**49 - 1, "fd ff ff ff ff ff ff"),
    (2**49, "fe 02 00 00 00 00 00 00"),  # 11111110 +7: no value bits in the first byte
    (2**56 - 1, "fe ff ff ff ff ff ff ff"),
    (2**56, "ff 01 00 00 00 00 00 00 00"),  # 11111111 +8: a full 64-bit value follows
    (2**64 - 1, "ff ff ff ff ff ff ff ff ff"),
]


@pytest.mark.parametrize(("value", "hexstr"), VI64_GOLDEN)
def test_vi64_golden(value: int, hexstr: str) -> None:
    assert vi64_encode(value) == h(hexstr)
    assert Buffer(h(hexstr)).pull_vi64() == value


# -- control messages --------------------------------------------------------------------------

SETUP_GOLDEN = """
af 00                 # Type 0x2F00 as vi64: 10|101111 00000000
00 0d                 # Length 13
01                    # Setup Option delta type 1 -> PATH (odd: length-prefixed)
04 2f 6d 6f 71        # length 4, "/moq"
06                    # delta 6 -> type 7 MOQT_IMPLEMENTATION (odd)
05 6b 76 6e 65 74     # length 5, "kvnet"
"""
SETUP_MSG = Setup(path="/moq", implementation=b"kvnet")

SUBSCRIBE_GOLDEN = """
03                    # Type SUBSCRIBE
00 11                 # Length 17
00                    # Request ID 0 (client, even)
01                    # Track Namespace: 1 field
05 6b 76 6e 65 74     #   length 5, "kvnet"
02 62 31              # Track Name length 2, "b1"
02                    # Number of Parameters 2
20 80                 # delta 0x20 SUBSCRIBER_PRIORITY, uint8 128
01 01 02              # delta 1 -> 0x21 SUBSCRIPTION_FILTER, length 1, Filter Type 2 (Largest Object)
"""
SUBSCRIBE_MSG = Subscribe(
    0,
    (b"kvnet",),
    b"b1",
    MessageParameters(
        subscriber_priority=128, subscription_filter=SubscriptionFilter(FilterType.LARGEST_OBJECT)
    ),
)


@pytest.mark.parametrize(("text", "msg"), [(SETUP_GOLDEN, SETUP_MSG), (SUBSCRIBE_GOLDEN, SUBSCRIBE_MSG)])
def test_control_message_golden(text: str, msg: ControlMessage) -> None:
    assert encode_message(msg) == h(text)
    reader = ControlMessageReader()
    reader.feed(h(text))
    assert reader.next_message() == msg


# -- subgroup streams (section "Examples") -----------------------------------------------------

SUBGROUP_EXAMPLE_1 = """
14                    # SUBGROUP_HEADER 0x14: SUBGROUP_ID_MODE 0b10 (field present), priority present
02 00 00              # Track Alias 2, Group ID 0, Subgroup ID 0
00                    # Publisher Priority 0
00 04 61 62 63 64     # Object ID Delta 0 (ID 0), Payload Length 4, "abcd"
00 04 65 66 67 68     # Object ID Delta 0 (ID 1), Payload Length 4, "efgh"
"""
SUBGROUP_EXAMPLE_1_ITEMS: list[DataStreamItem] = [
    SubgroupHeader(2, 0, 0, SubgroupIdMode.EXPLICIT, 0),
    SubgroupObject(0, b"abcd"),
    SubgroupObject(1, b"efgh"),
]

# The draft's second example says "Properties Length = 33" and "Length = 21" for a 14-byte
# value; those numbers do not add up, so the vector uses the real lengths (22 and 14).
SUBGROUP_EXAMPLE_2 = """
35                    # 0x35: PROPERTIES | SUBGROUP_ID_MODE 0b10 | DEFAULT_PRIORITY (no priority byte)
02 00 00              # Track Alias 2, Group ID 0, Subgroup ID 0
00                    # Object ID Delta 0 (ID 0)
16                    # Properties Length 22
04 f0 82 57 dc d3     #   delta type 4 (even: vi64 value) 2186796243 = 0x8257dcd3 in 5 bytes
49 0e                 #   delta 73 -> type 77 (odd), length 14
74 72 61 63 65 49 44 3a 31 32 33 34 35 36   # "traceID:123456"
04 61 62 63 64        # Payload Length 4, "abcd"
00 00 04 65 66 67 68  # Object ID Delta 0 (ID 1), Properties Length 0, Payload Length 4, "efgh"
"""
SUBGROUP_EXAMPLE_2_ITEMS: list[DataStreamItem] = [
    SubgroupHeader(2, 0, 0, SubgroupIdMode.EXPLICIT, None, has_properties=True),
    SubgroupObject(0, b"abcd", properties=(KeyValuePair(4, 2186796243), KeyValuePair(77, b"traceID:123456"))),
    SubgroupObject(1, b"efgh"),
]


@pytest.mark.parametrize(
    ("text", "items"),
    [(SUBGROUP_EXAMPLE_1, SUBGROUP_EXAMPLE_1_ITEMS), (SUBGROUP_EXAMPLE_2, SUBGROUP_EXAMPLE_2_ITEMS)],
)
def test_subgroup_golden(text: str, items: list[DataStreamItem]) -> None:
    header = items[0]
    assert isinstance(header, SubgroupHeader)
    encoded = encode_subgroup_header(header)
    prev = None
    for obj in items[1:]:
        assert isinstance(obj, SubgroupObject)
        encoded += encode_subgroup_object(header, obj, prev)
        prev = obj.object_id
    assert encoded == h(text)
    reader = DataStreamReader()
    reader.feed(h(text), end_stream=True)
    got = []
    while (item := reader.next_item()) is not None:
        got.append(item)
    assert got == [*items, StreamEnd()]


# -- fetch stream (sections "Fetch Header", "Flags", "End of Range") ---------------------------

FETCH_GOLDEN = """
05 07                 # FETCH_HEADER, Request ID 7
1c 03 00 80 02 68 69  # flags 0x1c: Group ID (0x08), Object ID (0x04), Priority (0x10), subgroup 0;
                      #   Group 3, Object 0, Priority 128, Payload Length 2, "hi"
00 01 21              # flags 0x00: same group, Object ID prior+1 = 1, subgroup 0, same priority; "!"
81 0c 03 05           # 0x10C End of Unknown Range through {3, 5} (absolute IDs)
4c 01 00 00           # flags 0x4c: Datagram (0x40), Group ID Delta 1 -> 3+1+1 = 5, Object ID 0, empty
"""
FETCH_ITEMS: list[FetchObject | FetchEndOfRange] = [
    FetchObject(3, 0, 0, 128, b"hi"),
    FetchObject(3, 1, 0, 128, b"!"),
    FetchEndOfRange(3, 5, unknown=True),
    FetchObject(5, 0, None, 128, b""),
]


def test_fetch_golden() -> None:
    enc = FetchObjectEncoder()
    encoded = encode_fetch_header(FetchHeader(7)) + b"".join(enc.encode(i) for i in FETCH_ITEMS)
    assert encoded == h(FETCH_GOLDEN)
    reader = DataStreamReader()
    reader.feed(h(FETCH_GOLDEN), end_stream=True)
    got = []
    while (item := reader.next_item()) is not None:
        got.append(item)
    assert got == [FetchHeader(7), *FETCH_ITEMS, StreamEnd()]
