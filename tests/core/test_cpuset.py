"""CpuSet: the strict parsers (a long table, after k8s.io/utils/cpuset), formatting, algebra."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmpin.core.cpuset import EMPTY, MAX_CPUS, CpuSet, checked, parse_cpus
from vmpin.core.errors import CpuSetError, VmpinError

# -- the list format ------------------------------------------------------------------------

VALID_LISTS = [
    ("", []),
    (" ", []),
    ("\n", []),
    ("0", [0]),
    ("7", [7]),
    ("0-3", [0, 1, 2, 3]),
    ("0-3,8", [0, 1, 2, 3, 8]),
    ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
    ("3-3", [3]),
    ("5,1,3", [1, 3, 5]),  # order does not matter
    ("1,1", [1]),  # nor do repeats
    ("0-2,1-3", [0, 1, 2, 3]),  # overlapping ranges
    ("01", [1]),  # leading zero: still CPU 1
    ("0-3\n", [0, 1, 2, 3]),  # sysfs files end in a newline
    (" 0-3 ", [0, 1, 2, 3]),  # whitespace around the whole string
    ("\t2,4\n", [2, 4]),
    (f"{MAX_CPUS - 1}", [MAX_CPUS - 1]),
    (f"{MAX_CPUS - 2}-{MAX_CPUS - 1}", [MAX_CPUS - 2, MAX_CPUS - 1]),
    ("0-111", list(range(112))),
]


@pytest.mark.parametrize(("text", "cpus"), VALID_LISTS)
def test_parse_valid(text: str, cpus: list[int]) -> None:
    s = CpuSet.parse(text)
    assert s.sorted() == cpus
    assert parse_cpus(text) == s


INVALID_LISTS = [
    "0,",  # trailing comma
    ",3",  # leading comma
    "1,,2",  # empty element
    ",",
    "1-",  # open range
    "-3",  # open range / sign
    "-1",  # negative
    "3-1",  # backwards
    "3-0",
    "0--3",
    "0-3-5",
    "1-2-",
    "a",
    "0x3",  # a mask is not a list
    "1.5",
    "+1",
    "1 ,2",  # inner whitespace
    "1, 2",
    "1 - 3",
    "1\n2",
    "0-3;8",
    f"{MAX_CPUS}",  # beyond NR_CPUS
    f"0-{MAX_CPUS}",
    "99999",
    "123456789012345678901234567890",
    "\u0663",  # ARABIC-INDIC DIGIT THREE: isdigit() but not a CPU number
    "\uff11",  # FULLWIDTH DIGIT ONE
    "\u00b2",  # SUPERSCRIPT TWO
    "0-\u00b3",  # SUPERSCRIPT THREE
    "1_000",
    "0b1",
]


@pytest.mark.parametrize("text", INVALID_LISTS)
def test_parse_invalid(text: str) -> None:
    with pytest.raises(CpuSetError) as err:
        CpuSet.parse(text)
    # The message names the input it refused.
    assert repr(text) in str(err.value)


@pytest.mark.parametrize("value", [None, 3, b"0-3", ["0"]])
def test_parse_not_a_string(value: object) -> None:
    with pytest.raises(CpuSetError):
        CpuSet.parse(value)  # type: ignore[arg-type]


def test_errors_are_vmpin_and_value_errors() -> None:
    with pytest.raises(VmpinError):
        CpuSet.parse("3-1")
    with pytest.raises(ValueError):
        CpuSet.parse("3-1")


@pytest.mark.parametrize("cpus", [[-1], [MAX_CPUS], [True], [1.0], ["1"], [None]], ids=repr)
def test_constructor_rejects_non_cpus(cpus: list[object]) -> None:
    with pytest.raises(CpuSetError):
        CpuSet(cpus)  # type: ignore[arg-type]


# -- the kernel's hex mask ----------------------------------------------------------------------

VALID_MASKS = [
    ("0", []),
    ("00000000", []),
    ("1", [0]),
    ("3", [0, 1]),
    ("ff", list(range(8))),
    ("FF", list(range(8))),
    ("80000000", [31]),
    ("00000003\n", [0, 1]),  # /proc/PID/status line value with its newline
    ("1,00000000", [32]),
    ("ff,00000001", [0, *range(32, 40)]),
    ("00000000,00000000,00000001", [0]),
    ("ffff,ffffffff,ffffffff,ffffffff", list(range(112))),  # 112 CPUs, nr_cpu_ids=112
    ("80000000,00000000", [63]),
]


@pytest.mark.parametrize(("text", "cpus"), VALID_MASKS)
def test_parse_mask_valid(text: str, cpus: list[int]) -> None:
    assert CpuSet.parse_mask(text).sorted() == cpus


INVALID_MASKS = [
    "",  # the kernel never prints an empty mask
    " ",
    "0x3",  # taskset form
    "ff,1",  # inner word narrower than 8 digits
    "ff,0000001",
    "ff,000000001",  # inner word wider than 8 digits
    "100000000",  # first word wider than 8 digits
    "ff,",
    ",ff",
    "ff,,00000000",
    "g",
    "ff 00000000",
    "-1",
    "1" + ",00000000" * (MAX_CPUS // 32),  # names CPU MAX_CPUS
]


@pytest.mark.parametrize("text", INVALID_MASKS, ids=lambda t: repr(t)[:40])
def test_parse_mask_invalid(text: str) -> None:
    with pytest.raises(CpuSetError):
        CpuSet.parse_mask(text)


def test_parse_mask_highest_cpu() -> None:
    text = "80000000" + ",00000000" * (MAX_CPUS // 32 - 1)
    assert CpuSet.parse_mask(text).sorted() == [MAX_CPUS - 1]


# -- taskset's mask -------------------------------------------------------------------------------

VALID_TASKSETS = [
    ("0x3", [0, 1]),
    ("0X3", [0, 1]),
    ("3", [0, 1]),
    ("0x0", []),
    ("0", []),
    ("0xff00", list(range(8, 16))),
    ("0xFF00", list(range(8, 16))),
    (" 0x1\n", [0]),
    ("0x100000000", [32]),
    ("0x" + "f" * 28, list(range(112))),
]


@pytest.mark.parametrize(("text", "cpus"), VALID_TASKSETS)
def test_parse_taskset_valid(text: str, cpus: list[int]) -> None:
    assert CpuSet.parse_taskset(text).sorted() == cpus


INVALID_TASKSETS = [
    "",
    "0x",
    "x3",
    "0xg",
    "0x-1",
    "-0x1",
    "0x 3",
    "0x3,0",  # the kernel's comma form is parse_mask's
    "0,1",  # a list is not a mask
    "0x0x3",
    "0x1" + "0" * (MAX_CPUS // 4),  # names CPU MAX_CPUS
]


@pytest.mark.parametrize("text", INVALID_TASKSETS, ids=lambda t: repr(t)[:40])
def test_parse_taskset_invalid(text: str) -> None:
    with pytest.raises(CpuSetError):
        CpuSet.parse_taskset(text)


# -- formatting ----------------------------------------------------------------------------------

FORMATS = [
    # cpus, list, mask, taskset
    ([], "", "00000000", "0x0"),
    ([0], "0", "00000001", "0x1"),
    ([0, 1, 2, 3, 8], "0-3,8", "0000010f", "0x10f"),
    ([1, 3, 5], "1,3,5", "0000002a", "0x2a"),
    ([0, 1, 3, 4], "0-1,3-4", "0000001b", "0x1b"),
    ([31], "31", "80000000", "0x80000000"),
    ([32], "32", "00000001,00000000", "0x100000000"),
    ([0, 56], "0,56", "01000000,00000001", "0x100000000000001"),
    (list(range(8, 16)), "8-15", "0000ff00", "0xff00"),
]


@pytest.mark.parametrize(("cpus", "text", "mask", "taskset"), FORMATS)
def test_format(cpus: list[int], text: str, mask: str, taskset: str) -> None:
    s = CpuSet(cpus)
    assert s.to_list() == text
    assert str(s) == text
    assert repr(s) == f"CpuSet({text!r})"
    assert s.to_mask() == mask
    assert s.to_taskset() == taskset
    assert s.to_int() == sum(1 << c for c in cpus)


@pytest.mark.parametrize(
    ("cpus", "ncpus", "mask"),
    [
        ([0], 112, "00000000,00000000,00000000,00000001"),
        ([0], 32, "00000001"),
        ([0], 33, "00000000,00000001"),
        ([], 64, "00000000,00000000"),
        ([40], 8, "00000100,00000000"),  # never narrower than the highest CPU
    ],
)
def test_to_mask_width(cpus: list[int], ncpus: int, mask: str) -> None:
    assert CpuSet(cpus).to_mask(ncpus) == mask


# -- properties ------------------------------------------------------------------------------------

cpu_numbers = st.integers(min_value=0, max_value=MAX_CPUS - 1)
small_cpus = st.integers(min_value=0, max_value=130)
cpusets = st.builds(
    CpuSet, st.one_of(st.frozensets(small_cpus, max_size=40), st.frozensets(cpu_numbers))
)
small_sets = st.builds(CpuSet, st.frozensets(small_cpus))


@given(cpusets)
def test_list_round_trip(s: CpuSet) -> None:
    assert CpuSet.parse(s.to_list()) == s
    assert CpuSet.parse(s.to_list() + "\n") == s


@given(cpusets)
def test_mask_round_trip(s: CpuSet) -> None:
    assert CpuSet.parse_mask(s.to_mask()) == s


@given(cpusets, st.integers(min_value=1, max_value=MAX_CPUS))
def test_mask_round_trip_any_width(s: CpuSet, ncpus: int) -> None:
    mask = s.to_mask(ncpus)
    assert all(len(word) == 8 for word in mask.split(","))
    assert CpuSet.parse_mask(mask) == s


@given(cpusets)
def test_taskset_round_trip(s: CpuSet) -> None:
    assert CpuSet.parse_taskset(s.to_taskset()) == s
    assert CpuSet.parse_taskset(s.to_taskset()[2:]) == s


@given(cpusets)
def test_list_is_canonical(s: CpuSet) -> None:
    # Ranges collapsed, ascending: re-formatting a parsed list gives the same text.
    text = s.to_list()
    assert CpuSet.parse(text).to_list() == text
    assert len(s) == len(s.sorted()) == len(list(s))
    assert list(s) == sorted(s.sorted())


@given(small_sets, small_sets)
def test_commutative(a: CpuSet, b: CpuSet) -> None:
    assert a | b == b | a
    assert a & b == b & a
    assert a ^ b == b ^ a


@given(small_sets, small_sets, small_sets)
def test_associative(a: CpuSet, b: CpuSet, c: CpuSet) -> None:
    assert (a | b) | c == a | (b | c) == a.union(b, c)
    assert (a & b) & c == a & (b & c)
    assert (a ^ b) ^ c == a ^ (b ^ c)


@given(small_sets, small_sets, small_sets)
def test_distributive(a: CpuSet, b: CpuSet, c: CpuSet) -> None:
    assert a & (b | c) == (a & b) | (a & c)
    assert a | (b & c) == (a | b) & (a | c)
    assert a - (b | c) == (a - b) & (a - c)
    assert a - (b & c) == (a - b) | (a - c)


@given(small_sets, small_sets)
def test_de_morgan(a: CpuSet, b: CpuSet) -> None:
    universe = a | b | CpuSet(range(131))
    assert universe - (a | b) == (universe - a) & (universe - b)
    assert universe - (a & b) == (universe - a) | (universe - b)
    assert universe - (universe - a) == a


@given(small_sets, small_sets)
def test_difference_and_intersection(a: CpuSet, b: CpuSet) -> None:
    assert (a - b) | (a & b) == a
    assert (a - b) & b == EMPTY
    assert (a - b).isdisjoint(b)
    assert a - a == EMPTY
    assert a & a == a | a == a
    assert a | EMPTY == a
    assert a & EMPTY == EMPTY
    assert a - EMPTY == a
    assert a ^ b == (a - b) | (b - a)
    assert len(a | b) == len(a) + len(b) - len(a & b)


@given(small_sets, small_sets)
def test_subset(a: CpuSet, b: CpuSet) -> None:
    assert (a <= b) == a.issubset(b) == (a | b == b) == (a & b == a) == (not (a - b))
    assert (a < b) == (a <= b and a != b)
    assert a & b <= a <= a | b
    assert EMPTY.issubset(a)
    assert a.isdisjoint(b) == (not (a & b))


@given(st.lists(small_sets, max_size=6))
def test_union_all(sets: list[CpuSet]) -> None:
    expected = EMPTY
    for s in sets:
        expected = expected | s
    assert CpuSet.union_all(sets) == expected
    assert CpuSet.union_all(iter(sets)) == expected


@given(small_sets)
def test_membership_and_first(s: CpuSet) -> None:
    for cpu in range(131):
        assert (cpu in s) == (cpu in s.sorted())
    assert bool(s) == (len(s) > 0)
    if s:
        assert s.first() == min(s.sorted())
    else:
        with pytest.raises(CpuSetError):
            s.first()


@given(small_sets, small_sets)
def test_equal_sets_hash_equal(a: CpuSet, b: CpuSet) -> None:
    assert (a == b) == (a.sorted() == b.sorted())
    if a == b:
        assert hash(a) == hash(b)
    assert hash(CpuSet(a.sorted())) == hash(a)


# -- values -------------------------------------------------------------------------------------


def test_operations_return_new_sets() -> None:
    a, b = CpuSet.parse("0-3"), CpuSet.parse("2-5")
    for result in (a | b, a & b, a - b, a ^ b, a.union(b), a.intersection(b), a.difference(b)):
        assert isinstance(result, CpuSet)
    assert a == CpuSet.parse("0-3")
    assert b == CpuSet.parse("2-5")


def test_immutable() -> None:
    s = CpuSet.parse("0-3")
    with pytest.raises(AttributeError):
        s._cpus = frozenset({9})  # type: ignore[misc]
    with pytest.raises(AttributeError):
        s.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        del s._cpus
    assert s == CpuSet.parse("0-3")
    assert not hasattr(s, "__dict__")
    assert not hasattr(s, "add")


def test_hashable() -> None:
    a, b = CpuSet.parse("0-3,8"), CpuSet([8, 3, 2, 1, 0])
    assert a == b and hash(a) == hash(b)
    assert len({a, b, CpuSet.parse("0")}) == 2
    table = {a: "x"}
    assert table[b] == "x"
    assert CpuSet() == EMPTY == CpuSet.parse("")
    assert a != "0-3,8"
    assert a != {0, 1, 2, 3, 8}


def test_input_iterable_copied() -> None:
    source = [1, 2]
    s = CpuSet(source)
    source.append(3)
    assert s.sorted() == [1, 2]
    assert CpuSet(x for x in (4, 5)).sorted() == [4, 5]


# -- the kernel's grammar (lib/bitmap-str.c bitmap_parselist), for what runtimes stored -------
KERNEL_ACCEPTS = [
    ("0-7:2/4", None, "0-1,4-5"),  # stride: 2 used of every 4
    ("0-15:1/8", None, "0,8"),
    ("1,,0", None, "0-1"),  # empty groups are skipped
    (",3,", None, "3"),
    (" 2 5\t7 ", None, "2,5,7"),  # whitespace separates groups too
    ("0-3\n", None, "0-3"),  # the newline the kernel prints
    ("1\n2", None, "1"),  # and a newline ends the list
    ("", None, ""),
    ("N", 8, "7"),  # N: the last CPU (nr_cpu_ids - 1)
    ("4-N", 8, "4-7"),
    ("0-N:1/2", 8, "0,2,4,6"),
    ("all", 4, "0-3"),
    ("ALL:1/2", 4, "0,2"),
    ("007", None, "7"),
]


@pytest.mark.parametrize(("text", "nbits", "want"), KERNEL_ACCEPTS)
def test_parse_kernel_accepts_what_the_kernel_accepts(
    text: str, nbits: int | None, want: str
) -> None:
    got = CpuSet.parse_kernel(text, nbits)
    assert got == CpuSet.parse(want)
    assert got.to_list() == want  # written back in the one normal form


KERNEL_REFUSES = [
    ("3-1", None, "backwards"),
    ("1-", None, "expected a number"),
    ("-1", None, "expected a number"),
    ("+1", None, "expected a number"),
    ("0x3", None, "unexpected 'x'"),
    ("0-7:2", None, "used/group"),
    ("0-7:3/2", None, "stride 3/2"),
    ("0-7:1/0", None, "stride 1/0"),
    ("N", None, "needs the CPU count"),
    ("all", None, "needs the CPU count"),
    ("8", 8, "beyond 7"),
    ("99999999999", None, "overflows"),
    ("1.5", None, "unexpected '.'"),
]


@pytest.mark.parametrize(("text", "nbits", "why"), KERNEL_REFUSES)
def test_parse_kernel_refuses_what_the_kernel_refuses(
    text: str, nbits: int | None, why: str
) -> None:
    with pytest.raises(CpuSetError) as info:
        CpuSet.parse_kernel(text, nbits)
    assert why in str(info.value)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["0-7:2/4", "1,,0", "N", " 1 2", "all"])
def test_strict_parser_still_refuses_kernel_only_forms(text: str) -> None:
    # user input (--cpuset-cpus) keeps the strict grammar: one clear error, not a guess
    with pytest.raises(CpuSetError):
        CpuSet.parse(text)


def test_checked_is_the_set_of_cpus_already_checked() -> None:
    """What a plan derives from checked sets is the set CpuSet would make, unchecked again."""
    for cpus in ((), (3,), (0, 1, 2, 7), range(MAX_CPUS - 2, MAX_CPUS)):
        got = checked(cpus)
        assert got == CpuSet(cpus) and hash(got) == hash(CpuSet(cpus))
        assert got.to_list() == CpuSet(cpus).to_list() and list(got) == sorted(cpus)
    assert checked(()) == EMPTY and not checked(())
