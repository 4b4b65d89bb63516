"""memwal_core.state.layout: bit-reversed names, generation paths and their validation.

The names are checked against the spec's worked examples and against the files pylance 14
actually writes for a real region (manifests, WAL entries, generation directories).
"""

from __future__ import annotations

import os
import uuid

import pytest

from memwal_core.state import layout, region
from memwal_core.state.layout import UnsafePath
from memwal_core.tools import demo

RID = "0f8fad5b-d9cb-469f-a165-70867728950e"


# --------------------------------------------------------------------------- bit reversal
def test_bitrev_spec_examples():
    # Spec: "entry ID 5 (binary 000...101) becomes 1010000...0" / "version 5 becomes 1010...0.binpb".
    assert layout.bitrev(5) == "101" + "0" * 61
    assert layout.bitrev(5) == "1010000000000000000000000000000000000000000000000000000000000000"
    assert layout.bitrev(1) == "1" + "0" * 63
    assert layout.bitrev(2) == "01" + "0" * 62
    assert layout.bitrev(0) == "0" * 64
    assert layout.bitrev(2**63) == "0" * 63 + "1"
    assert layout.bitrev(2**64 - 1) == "1" * 64
    assert all(len(layout.bitrev(n)) == 64 for n in (0, 1, 12345, 2**40 + 7))
    assert layout.manifest_key(RID, 5) == f"_mem_wal/{RID}/manifest/{'101' + '0' * 61}.binpb"
    assert layout.wal_key(RID, 5) == f"_mem_wal/{RID}/wal/{'101' + '0' * 61}.arrow"
    assert layout.version_hint_key(RID) == f"_mem_wal/{RID}/manifest/version_hint.json"


@pytest.mark.parametrize("n", [-1, 2**64, 2**70])
def test_bitrev_rejects_out_of_range(n):
    with pytest.raises(ValueError, match="64 bits"):
        layout.bitrev(n)


def test_parse_bitrev_is_the_inverse():
    for n in [0, 1, 2, 3, 5, 6, 7, 8, 255, 256, 1000, 123456789, 2**32 + 1, 2**63, 2**64 - 1]:
        name = layout.bitrev(n)
        assert layout.parse_bitrev(name) == n
        assert layout.parse_bitrev(name + ".binpb") == n
        assert layout.parse_bitrev(name + ".arrow") == n
    # Distinct numbers get distinct names (it is a bijection on 64 bits).
    assert len({layout.bitrev(n) for n in range(5000)}) == 5000


@pytest.mark.parametrize("name", [
    "version_hint.json", "", "101", "1" * 63 + ".binpb", "1" * 65, "2" + "0" * 63,
    ".memwal-tmp-abc", "x" * 64, "1" * 64 + "\n", "1" * 64 + "\n.binpb",
])
def test_parse_bitrev_rejects_other_names(name):
    assert layout.parse_bitrev(name) is None


# --------------------------------------------------------------------------- generation paths
@pytest.mark.parametrize("path,gen", [("0f821aff_gen_12", 12), ("0f821aff_gen_12", None),
                                      ("00000000_gen_1", 1), ("deadbeef_gen_999999", 999999)])
def test_validate_generation_path_accepts(path, gen):
    assert layout.validate_generation_path(path, gen) == path
    assert layout.generation_dir(RID, path, gen) == f"_mem_wal/{RID}/{path}"


@pytest.mark.parametrize("path", [
    "/abs", "/tmp/0f821aff_gen_12", "/", "..", "../../x", "../0f821aff_gen_12",
    "0f821aff_gen_12/..", "0f821aff_gen_12/../../x", "a/0f821aff_gen_12", "0f821aff_gen_12/",
    "..\\0f821aff_gen_12", "C:0f821aff_gen_12", "s3:0f821aff_gen_12",
])
def test_validate_generation_path_rejects_escapes(path):
    with pytest.raises(UnsafePath) as e:
        layout.validate_generation_path(path)
    assert repr(path) in str(e.value)
    with pytest.raises(UnsafePath):
        layout.generation_dir(RID, path, 12)


@pytest.mark.parametrize("path", [
    "", "0f821aff_gen_", "0f821aff_gen_0", "0f821aff_gen_012", "0F821AFF_gen_12", "0f821af_gen_12",
    "0f821affa_gen_12", "0f821aff-gen-12", "0f821aff_gen_12x", "xf821aff_gen_12", "gen_12",
    "0f821aff_gen_12 ", " 0f821aff_gen_12", "0f821aff_gen_-1", "0f821aff_GEN_12",
    "0f821aff_gen_12\n", "0f821aff_gen_12\x00",
])
def test_validate_generation_path_rejects_wrong_pattern(path):
    with pytest.raises(UnsafePath):
        layout.validate_generation_path(path)


@pytest.mark.parametrize("bad", [None, 12, b"0f821aff_gen_12"])
def test_validate_generation_path_rejects_non_strings(bad):
    with pytest.raises(UnsafePath):
        layout.validate_generation_path(bad)


def test_validate_generation_path_checks_generation_number():
    with pytest.raises(UnsafePath, match="does not belong to generation 13"):
        layout.validate_generation_path("0f821aff_gen_12", 13)
    with pytest.raises(UnsafePath, match="does not belong to generation 1"):
        layout.generation_dir(RID, "0f821aff_gen_12", 1)


def test_generation_dir_names_the_region_when_rejecting():
    with pytest.raises(UnsafePath) as e:
        layout.generation_dir(RID, "../../x", 1)
    assert RID in str(e.value) and "'../../x'" in str(e.value)


# --------------------------------------------------------------------------- region ids
def test_region_ids():
    rid = str(uuid.uuid4())
    assert layout.is_region_id(rid)
    assert layout.region_dir(rid) == f"_mem_wal/{rid}"
    assert layout.manifest_dir(rid) == f"_mem_wal/{rid}/manifest"
    assert layout.wal_dir(rid) == f"_mem_wal/{rid}/wal"
    for bad in ["", "not-a-uuid", rid.replace("-", ""), rid + "\n", "{" + rid + "}", rid + "/..",
                "../" + rid, "urn:uuid:" + rid]:
        assert not layout.is_region_id(bad), bad
        with pytest.raises(UnsafePath):
            layout.region_dir(bad)
        with pytest.raises(UnsafePath):
            layout.manifest_key(bad, 1)


def test_generation_of_dir_and_is_inside():
    assert layout.generation_of_dir("0f821aff_gen_12") == 12
    assert layout.generation_of_dir("weird_gen_3") == 3
    assert layout.generation_of_dir("manifest") is None
    assert layout.generation_of_dir("wal") is None
    assert layout.generation_of_dir("0f821aff_gen_12\n") is None
    d = f"_mem_wal/{RID}"
    assert layout.is_inside(f"{d}/0f821aff_gen_1/data/x.lance", d)
    assert layout.is_inside(f"{d}/wal/{layout.bitrev(1)}.arrow", d + "/")
    assert not layout.is_inside(d, d)
    assert not layout.is_inside(f"{d}/../other/x", d)
    assert not layout.is_inside(f"{d}x/file", d)  # sibling with a common prefix
    assert not layout.is_inside(f"{d}//x", d)
    assert not layout.is_inside(f"{d}/./x", d)


# --------------------------------------------------------------------------- agreement with pylance
def test_names_match_what_pylance_writes(table_loc):
    """Every manifest / WAL file pylance wrote parses as a bit-reversed number and the
    keys layout builds for versions 1..latest and positions 1..tail are exactly those files."""
    demo.create_table(table_loc, sharding="unsharded")
    w = demo.Workload(table_loc, max_memtable_rows=20, key_space=100)
    w.write_round(40, puts_per_batch=10)
    w.write_round(40, puts_per_batch=10)  # re-open: epoch bump + fence sentinel
    (rid,) = w.regions.values()
    root = table_loc.store.root
    mdir = os.path.join(root, layout.manifest_dir(rid))
    manifests = sorted(f for f in os.listdir(mdir) if f.endswith(".binpb"))
    versions = sorted(layout.parse_bitrev(f) for f in manifests)
    assert versions == list(range(1, len(manifests) + 1)) and len(versions) >= 4
    assert sorted(layout.manifest_key(rid, v).rsplit("/", 1)[1] for v in versions) == manifests
    assert os.path.exists(os.path.join(root, layout.version_hint_key(rid)))

    wal_files = sorted(os.listdir(os.path.join(root, layout.wal_dir(rid))))
    positions = sorted(layout.parse_bitrev(f) for f in wal_files)
    assert positions == list(range(1, len(wal_files) + 1)) and len(positions) >= 3
    assert all(f.endswith(layout.WAL_SUFFIX) for f in wal_files)

    latest = region.load_latest(table_loc.store, rid)
    gen_dirs = sorted(d for d in os.listdir(os.path.join(root, layout.region_dir(rid)))
                      if layout.generation_of_dir(d) is not None)
    assert gen_dirs == sorted(g.path for g in latest.generations) and len(gen_dirs) >= 2
    for g in latest.generations:
        assert layout.validate_generation_path(g.path, g.generation) == g.path
        assert os.path.isdir(os.path.join(root, layout.generation_dir(rid, g.path, g.generation)))
