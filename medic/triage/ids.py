"""The event ids a triage has seen, exactly, in little memory."""

from __future__ import annotations

from array import array


class EventIds:
    """The event ids seen so far, exactly, in two flat arrays: each id's UTF-8 bytes after a
    two-byte length in one buffer, and an open-addressing table of where each starts. About 20
    bytes an id, where a set of strings costs about 100: the one thing triage keeps for the whole
    input, so that a repeated id is dropped wherever it comes. Ids are compared whole, so no two
    different ids are confused.

    A slot is a C unsigned int (four bytes) while the buffer is under 4 GiB, eight bytes past that:
    at a million ids the table is 8 MiB, not 16. No hash bits fit beside the start, so a probe
    compares the id itself; with at most half the slots used, an id new to the table (most are)
    meets one used slot on average."""

    __slots__ = ("_ids", "_slots", "_used")

    def __init__(self) -> None:
        self._ids = bytearray()
        self._slots = array("I", bytes(4 * 1024))  # 0: empty; else where the id starts, plus 1
        self._used = 0

    @property
    def nbytes(self) -> int:
        """The memory the two arrays take."""
        return len(self._ids) + len(self._slots) * self._slots.itemsize

    def add(self, event_id: str) -> bool:
        """Remember `event_id`: True if it is new."""
        data = event_id.encode("utf-8", "surrogatepass")  # ids are at most 200 characters
        stored = len(data).to_bytes(2, "little") + data  # as the buffer holds it
        entry = len(self._ids) + 1
        if entry >= WIDE_FROM and self._slots.typecode == "I":
            self._slots = array("Q", self._slots)
        if not self._put(stored, entry):
            return False
        self._ids += stored
        self._used += 1
        if self._used * 2 > len(self._slots):
            self._grow()
        return True

    def _put(self, stored: bytes, entry: int) -> bool:
        """Put `entry` in the first free slot for the id `stored` (its length, then its bytes),
        unless the id is there already."""
        slots, ids = self._slots, self._ids
        mask = len(slots) - 1
        index = hash(stored) & mask
        while found := slots[index]:
            if ids[found - 1 : found - 1 + len(stored)] == stored:
                return False
            index = (index + 1) & mask
        slots[index] = entry
        return True

    def _grow(self) -> None:
        old = self._slots
        self._slots = array(old.typecode, bytes(2 * len(old) * old.itemsize))
        ids = self._ids
        for found in old:
            if found:
                end = found + 1 + int.from_bytes(ids[found - 1 : found + 1], "little")
                self._put(bytes(ids[found - 1 : end]), found)


WIDE_FROM = 2 ** (8 * array("I").itemsize)  # the first slot value (a start, plus 1) "I" cannot hold


WIDE_FROM = 2 ** (8 * array("I").itemsize)  # the first slot value (a start, plus 1) "I" cannot hold
