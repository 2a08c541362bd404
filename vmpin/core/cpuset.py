"""CpuSet: the immutable set of CPU numbers that every part of vmpin passes around.

Three text forms reach vmpin from the kernel and from users, and each has its own parser:

- the Linux list format ("0-3,8,10-11"): cpuset.cpus, sysfs cpulists, OCI
  ``linux.resources.cpu.cpus``, ``Cpus_allowed_list``;
- the kernel's hex mask ("ff,00000001"): ``Cpus_allowed`` in /proc/PID/status, 32-bit words
  separated by commas, most significant first;
- taskset's mask ("0x3", or plain hex without the prefix).

Two readers of the list format, on purpose:

- :meth:`CpuSet.parse` is strict, after k8s.io/utils/cpuset, for what a *user* types
  (``--cpuset-cpus``): a stray comma, a reversed range ("3-1"), an open range ("1-"), a sign or
  a number beyond the kernel's NR_CPUS limit is an error naming the input, never a silently
  smaller set.  The only lenient spots are the ones the kernel itself writes: surrounding
  whitespace and a trailing newline, and the empty string for the empty set.
- :meth:`CpuSet.parse_kernel` accepts exactly what the kernel's ``bitmap_parselist()``
  (lib/bitmap-str.c; cpuset.cpus goes through ``cpulist_parse``) accepts, for what other
  programs *stored* after the kernel took it (runc keeps ``--cpuset-cpus`` verbatim in its
  state): groups separated by commas or whitespace with empty groups skipped ("1,,0"),
  ``a``, ``a-b``, ``a-b:used/group`` strides ("0-7:2/4" is 0,1,4,5), ``N`` for the last CPU and
  ``all`` (kernels >= 5.13; they need the CPU count ``nbits``).

Every set is written back in the one normal form, :meth:`CpuSet.to_list`.
"""

from __future__ import annotations

from vmpin.core.errors import CpuSetError

TYPE_CHECKING = False  # collections.abc imports collections (~1 ms of a hook): types only
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

#: The kernel's CONFIG_NR_CPUS maximum is 8192; anything above cannot be a CPU.
MAX_CPUS = 8192


class CpuSet:
    """An immutable, hashable set of CPU numbers; every operation returns a new set."""

    __slots__ = ("_cpus", "_text")
    _cpus: frozenset[int]
    _text: str  # to_list()'s answer, kept once asked: a pass prints the same sets many times

    def __init__(self, cpus: Iterable[int] = ()) -> None:
        frozen = frozenset(cpus)
        for cpu in frozen:
            if not isinstance(cpu, int) or isinstance(cpu, bool) or not 0 <= cpu < MAX_CPUS:
                raise CpuSetError(f"not a CPU number: {cpu!r} (must be 0..{MAX_CPUS - 1})")
        object.__setattr__(self, "_cpus", frozen)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CpuSet is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("CpuSet is immutable")

    # -- parsing -------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> CpuSet:
        """Parse the Linux list format; "" (or only whitespace) is the empty set."""
        if not isinstance(text, str):
            raise CpuSetError(f"CPU list must be a string, got {type(text).__name__}")
        body = text.strip()
        if not body:
            return EMPTY
        cpus: set[int] = set()
        for part in body.split(","):
            if not part:
                raise CpuSetError(f"invalid CPU list {text!r}: empty element")
            lo_text, sep, hi_text = part.partition("-")
            lo = _number(lo_text, text)
            if not sep:
                cpus.add(lo)
                continue
            hi = _number(hi_text, text)
            if hi < lo:
                raise CpuSetError(f"invalid CPU list {text!r}: range {part!r} runs backwards")
            cpus.update(range(lo, hi + 1))
        return cls(cpus)

    @classmethod
    def parse_kernel(cls, text: str, nbits: int | None = None) -> CpuSet:
        """Parse a CPU list as the kernel's ``bitmap_parselist()`` does.

        ``nbits`` is the bitmap size the kernel parses against (nr_cpu_ids for a cpumask):
        ``N`` and ``all`` mean its last bit, and a CPU at or beyond it is -ERANGE.  Without
        it the limit is :data:`MAX_CPUS` and ``N``/``all`` are refused (their value is unknown).
        """
        if not isinstance(text, str):
            raise CpuSetError(f"CPU list must be a string, got {type(text).__name__}")
        limit = MAX_CPUS if nbits is None else min(nbits, MAX_CPUS)
        cpus: set[int] = set()
        n = len(text)
        i = 0

        def fail(why: str) -> CpuSetError:
            return CpuSetError(f"invalid CPU list {text!r}: {why}")

        def getnum(j: int) -> tuple[int, int]:
            # bitmap_getnum(): "N" is the last bit, else decimal digits (no sign, no base).
            if j < n and text[j] == "N":
                if nbits is None:
                    raise fail("'N' needs the CPU count")
                return nbits - 1, j + 1
            k = j
            while k < n and "0" <= text[k] <= "9":
                k += 1
            if k == j:
                raise fail(f"expected a number at offset {j}")
            if k - j > 10 or int(text[j:k]) > 0xFFFFFFFF:
                raise fail(f"number {text[j:k]} overflows")
            return int(text[j:k]), k

        while True:
            # bitmap_find_region(): skip commas and whitespace; NUL or newline ends the list.
            while i < n and (text[i] == "," or text[i] in _KSPACE) and text[i] != "\n":
                i += 1
            if i >= n or text[i] == "\n":
                break
            if text[i : i + 3].lower() == "all":
                if nbits is None:
                    raise fail("'all' needs the CPU count")
                start, end, i = 0, nbits - 1, i + 3
            else:
                start, i = getnum(i)
                end = start
                if i < n and text[i] == "-":
                    end, i = getnum(i + 1)
                elif not _end_of_region(text, i):
                    raise fail(f"unexpected {text[i]!r} at offset {i}")
            used, group = end + 1, end + 1
            if not _end_of_region(text, i):
                if text[i] != ":":
                    raise fail(f"unexpected {text[i]!r} at offset {i}")
                used, i = getnum(i + 1)
                if i >= n or text[i] != "/":
                    raise fail("a stride is written used/group")
                group, i = getnum(i + 1)
            # bitmap_check_region()
            if start > end:
                raise fail(f"range {start}-{end} runs backwards")
            if group == 0 or used > group:
                raise fail(f"stride {used}/{group} is not used/group with 0 < group, used <= group")
            if end >= limit:
                raise fail(f"CPU {end} is beyond {limit - 1}")
            for base in range(start, end + 1, group):
                cpus.update(range(base, min(base + used, end + 1)))
        return cls(cpus)

    @classmethod
    def parse_mask(cls, text: str) -> CpuSet:
        """Parse the kernel's comma-separated 32-bit hex words ("ff,00000001")."""
        body = text.strip()
        if not body:
            raise CpuSetError("invalid CPU mask '': empty")
        words = body.split(",")
        value = 0
        for i, word in enumerate(words):
            if not word or len(word) > 8 or not _is_hex(word):
                raise CpuSetError(f"invalid CPU mask {text!r}: word {word!r} is not 1-8 hex digits")
            if i > 0 and len(word) != 8:
                raise CpuSetError(
                    f"invalid CPU mask {text!r}: inner word {word!r} must be 8 digits"
                )
            value = (value << 32) | int(word, 16)
        return cls._from_int(value, text)

    @classmethod
    def parse_taskset(cls, text: str) -> CpuSet:
        """Parse taskset's mask: "0x3", "0X3" or bare hex "3"."""
        body = text.strip()
        if body[:2] in ("0x", "0X"):
            body = body[2:]
        if not body or not _is_hex(body):
            raise CpuSetError(f"invalid taskset mask {text!r}: expected hex like 0x3")
        return cls._from_int(int(body, 16), text)

    @classmethod
    def _from_int(cls, value: int, text: str) -> CpuSet:
        if value.bit_length() > MAX_CPUS:
            raise CpuSetError(f"invalid CPU mask {text!r}: names CPUs beyond {MAX_CPUS - 1}")
        return cls(i for i in range(value.bit_length()) if value >> i & 1)

    # -- formatting ----------------------------------------------------------------------
    def to_list(self) -> str:
        """The Linux list format, ranges collapsed: {0,1,2,3,8} -> "0-3,8"."""
        try:
            return self._text
        except AttributeError:
            pass
        parts: list[str] = []
        cpus = sorted(self._cpus)
        i = 0
        while i < len(cpus):
            j = i
            while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
                j += 1
            parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
            i = j + 1
        text = ",".join(parts)
        object.__setattr__(self, "_text", text)
        return text

    def to_int(self) -> int:
        value = 0
        for cpu in self._cpus:
            value |= 1 << cpu
        return value

    def to_mask(self, ncpus: int | None = None) -> str:
        """The kernel's hex mask: 32-bit words, most significant first, as in Cpus_allowed.

        ``ncpus`` (nr_cpu_ids) sets the width the kernel would print; by default just wide
        enough for the highest CPU.
        """
        width = max(ncpus or 0, max(self._cpus, default=0) + 1)
        nwords = max(1, (width + 31) // 32)
        value = self.to_int()
        words = [(value >> (32 * i)) & 0xFFFFFFFF for i in reversed(range(nwords))]
        return ",".join(f"{w:08x}" for w in words)

    def to_taskset(self) -> str:
        return f"0x{self.to_int():x}"

    # -- set algebra ---------------------------------------------------------------------
    # Results are built by _of (their CPUs come from checked sets: nothing to check again),
    # and an operand that is already the result is returned itself: a set is immutable, and
    # one kept keeps its to_list() text (a node pass derives and prints thousands of sets).
    def union(self, *others: CpuSet) -> CpuSet:
        cpus = self._cpus.union(*(o._cpus for o in others))
        return self if len(cpus) == len(self._cpus) else _of(cpus)

    def intersection(self, other: CpuSet) -> CpuSet:
        cpus = self._cpus & other._cpus
        return self if len(cpus) == len(self._cpus) else _of(cpus)

    def difference(self, other: CpuSet) -> CpuSet:
        cpus = self._cpus - other._cpus
        return self if len(cpus) == len(self._cpus) else _of(cpus)

    def symmetric_difference(self, other: CpuSet) -> CpuSet:
        return _of(self._cpus ^ other._cpus)

    __or__ = union
    __and__ = intersection
    __sub__ = difference
    __xor__ = symmetric_difference

    def issubset(self, other: CpuSet) -> bool:
        return self._cpus <= other._cpus

    def isdisjoint(self, other: CpuSet) -> bool:
        return self._cpus.isdisjoint(other._cpus)

    __le__ = issubset

    def __lt__(self, other: CpuSet) -> bool:
        return self._cpus < other._cpus

    def sorted(self) -> list[int]:
        return sorted(self._cpus)

    def first(self) -> int:
        if not self._cpus:
            raise CpuSetError("the empty CPU set has no first CPU")
        return min(self._cpus)

    @staticmethod
    def union_all(sets: Iterable[CpuSet]) -> CpuSet:
        first: CpuSet | None = None
        out: set[int] = set()
        for s in sets:
            if first is None:
                first = s
            out |= s._cpus
        if first is None:
            return EMPTY
        return first if len(out) == len(first._cpus) else _of(frozenset(out))

    # -- container protocol --------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._cpus))

    def __len__(self) -> int:
        return len(self._cpus)

    def __bool__(self) -> bool:
        return bool(self._cpus)

    def __contains__(self, cpu: object) -> bool:
        return cpu in self._cpus

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuSet) and self._cpus == other._cpus

    def __hash__(self) -> int:
        return hash(self._cpus)

    def __repr__(self) -> str:
        return f"CpuSet({self.to_list()!r})"

    def __str__(self) -> str:
        return self.to_list()


def _of(cpus: frozenset[int]) -> CpuSet:
    """A CpuSet of CPUs taken from other CpuSets (already checked): no copy, no check."""
    new = object.__new__(CpuSet)
    object.__setattr__(new, "_cpus", cpus)
    return new


EMPTY = CpuSet()


def checked(cpus: Iterable[int]) -> CpuSet:
    """A CpuSet of CPU numbers taken from other CpuSets or a :class:`Topology`'s CPUs, which
    were checked when those were made: not checked one by one again (a plan derives a few
    a sandbox from its inputs' counts, and one per vCPU it pins 1:1)."""
    return _of(frozenset(cpus))


def listed(cpus: CpuSet | None) -> str | None:
    """A set in Linux list format, None for no set: how every view prints a CPU set."""
    return None if cpus is None else cpus.to_list()

_HEX = frozenset("0123456789abcdefABCDEF")


#: isspace() in the kernel's C locale (lib/ctype.c): space, \t, \n, \v, \f, \r.
_KSPACE = frozenset(" \t\n\v\f\r")


def _end_of_region(text: str, i: int) -> bool:
    # end_of_region(): a comma, whitespace, NUL (end of the Python string) or newline.
    return i >= len(text) or text[i] == "," or text[i] in _KSPACE


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in _HEX for c in text)


def _number(part: str, text: str) -> int:
    # str.isdigit() accepts non-ASCII digits ("²"); only 0-9 name a CPU.
    if not part or not part.isascii() or not part.isdigit():
        raise CpuSetError(f"invalid CPU list {text!r}: {part!r} is not a CPU number")
    if len(part) > 5 or int(part) >= MAX_CPUS:
        raise CpuSetError(f"invalid CPU list {text!r}: CPU {part} is beyond {MAX_CPUS - 1}")
    return int(part)


_PARSED: dict[str, CpuSet] = {}


def parse_cpus(text: str) -> CpuSet:
    """:meth:`CpuSet.parse`, remembered per distinct text: a pass parses a CPU list for every
    stored container and every thread's recorded affinity, and a node holds few distinct ones.
    (CpuSets are immutable, so sharing one is safe; the memo is bounded.)"""
    cpus = _PARSED.get(text)
    if cpus is None:
        if len(_PARSED) > 4096:
            _PARSED.clear()
        cpus = _PARSED[text] = CpuSet.parse(text)
    return cpus
