"""The C/Python interface of the native step is checked, not kept in step by hand: a build whose
structs or codes differ from flover/native/abi.py's declarations is refused with a message naming
the difference (each case below is a real build of sources changed on one side)."""

from __future__ import annotations

import shutil

import pytest

from flover.native import abi
from flover.native.build import KERNELS_ENV, SOURCES, NativeUnavailable, source_files


def test_the_build_in_the_tree_matches_python_entry_for_entry():
    lib = abi.load_library()
    theirs = abi.abi_of(lib)
    assert abi.abi_mismatches(abi.expected_abi(), theirs) == []
    assert theirs["Model"] == 8 * len(abi.Model._fields_) and theirs["Grid.part"] == 8


def changed_build(tmp_path, monkeypatch, changes: list[tuple[str, str]]):
    """load_library over a copy of the sources with each `old` replaced by its `new` in native.h."""
    root = tmp_path / "native"
    for path in source_files():
        (root / path.relative_to(SOURCES)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / path.relative_to(SOURCES))
    header = root / "native.h"
    for old, new in changes:
        assert old in header.read_text()
        header.write_text(header.read_text().replace(old, new))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(KERNELS_ENV, "generic")  # (the quickest build: generic, and unoptimized, below)
    quick = tmp_path / "quick-cc"  # (-O0 after the build's -O3: the layout of its structs is what is read)
    quick.write_text('#!/bin/sh\nexec cc "$@" -O0\n')
    quick.chmod(0o755)
    monkeypatch.setenv("CC", str(quick))
    return lambda: abi.load_library(root=root)


def test_a_build_that_differs_from_python_is_refused_naming_the_difference(tmp_path, monkeypatch):
    """Three changes to C only, in one build (each is named): two fields swapped (every size still
    agrees, two offsets do not), a field added (the struct's size and the fields after it), a code
    renumbered."""
    changes = [
        ("input_norm, qkv, qkv_bias, o, o_bias,", "input_norm, qkv, qkv_bias, o_bias, o,"),
        ("int64_t screen_rows;", "int64_t screen_rows, added_in_c;"),
        ("G_INT4_K = 5,", "G_INT4_K = 12,"),
    ]
    load = changed_build(tmp_path, monkeypatch, changes)
    with pytest.raises(NativeUnavailable, match="does not match flover/native/abi.py") as refused:
        load()
    for named in ("Layer.o is", "Model is", "G_INT4_K is 12 in the C build, 5 in"):
        assert named in str(refused.value), named


def test_a_field_python_declares_that_c_lacks_is_named(monkeypatch):
    lib = abi.load_library()
    extended = type("Layer", (abi.ctypes.Structure,), {"_fields_": [*abi.Layer._fields_, ("added", abi.I64)]})
    structs = tuple(extended if struct is abi.Layer else struct for struct in abi.STRUCTS)
    monkeypatch.setattr(abi, "STRUCTS", structs)
    differ = abi.abi_mismatches(abi.expected_abi(), abi.abi_of(lib))
    assert differ == [
        f"Layer is {8 * len(abi.Layer._fields_)} in the C build, {8 * len(extended._fields_)} in flover/native/abi.py",
        "Layer.added is declared in flover/native/abi.py but not in the C build",
    ]
