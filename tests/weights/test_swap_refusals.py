"""Weight operations that cannot be done are refused before they change anything: version ids
that are not names, drain without a second slot, and failures after staging began (the swap
manager on a real in-process engine, the tiny Llama)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sitsd.api.interceptors import status_for_exception
from sitsd.engine.errors import InvalidRequestError
from sitsd.weights.errors import (
    InvalidVersionIdError,
    SwapFailedError,
    SwapRefusedError,
    VersionRejectedError,
)
from sitsd.weights.manifest import write_manifest
from sitsd.weights.versions import (
    VersionRegistry,
    VersionState,
    check_version_id,
    version_id_from,
)
from tests.weights.test_swap_manager import Served
from tests.weights.tiny_versions import write_version

NOT_IDS = [
    "../../../../outside",
    "..",
    ".",
    "a/b",
    "/abs",
    "a\\b",
    "",
    " v1",
    "v1\n",
    "v\x00",
    "-rf",
    ".hidden",
    "v" * 129,
    "ünïcode",
]


@pytest.mark.parametrize("version", NOT_IDS)
def test_a_version_id_that_is_not_a_name_is_refused_naming_the_field(version):
    with pytest.raises(InvalidVersionIdError) as caught:
        check_version_id(version)
    assert str(caught.value).startswith("version: ")
    assert status_for_exception(caught.value)[0].name == "INVALID_ARGUMENT"
    registry = VersionRegistry("tiny")
    with pytest.raises(InvalidVersionIdError):
        registry.register(version, "/w/x", "d", "deploy", VersionState.STAGED)
    assert registry.list() == []


def test_names_are_version_ids_and_any_name_can_be_made_one(rng):
    for version in ("v1", "2025-06-01", "SmolLM2-135M@1a2b3c4d", "a.b_c+d", "v" * 128):
        assert check_version_id(version) == version
    for name in [
        *NOT_IDS,
        "my model (final)",
        "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(300)),
    ]:
        made = version_id_from(name)
        assert check_version_id(made) == made


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    return {
        "v1": write_version(root / "v1"),
        "v2": write_version(root / "v2", noise_seed=1),
        "v3": write_version(root / "v3", noise_seed=2),
    }


@pytest.fixture
def served(versions, tmp_path):
    instance = Served(versions["v1"], tmp_path / "state")
    yield instance
    instance.close()


def test_deploy_with_a_path_for_its_version_id_is_refused_and_registers_nothing(
    served,
    versions,
    tmp_path,
):
    before = served.manager.registry.list()
    with pytest.raises(InvalidVersionIdError, match="never a path"):
        served.run(served.manager.deploy(str(versions["v2"]), "../../../../outside"))
    with pytest.raises(InvalidVersionIdError):
        served.swap("../v1")
    odd = write_version(tmp_path / "odd name (copy)", noise_seed=3)
    with pytest.raises(InvalidVersionIdError, match="--version"):
        served.run(served.manager.deploy(str(odd)))  # its directory's name is no id
    assert served.manager.registry.list() == before
    assert not (tmp_path / "outside").exists()
    record = served.run(served.manager.deploy(str(odd), "odd"))  # named, it deploys
    assert record.state is VersionState.VALIDATED


def test_a_path_that_names_no_directory_is_a_client_error_and_registers_nothing(
    served, versions, tmp_path
):
    """Whatever string arrives as a deploy's path, the answer is INVALID_ARGUMENT on `path`:
    the operating system's refusals (a name too long, a symlink loop) are the request's fault."""
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("")
    before = served.manager.registry.list()
    odd = ["\u00e9" * 300, "a/" * 3000, "b" * 250, "v1\x00", "~no-such-user-here/v1"]
    for path in [*odd, *(str(tmp_path / name) for name in ("loop", "file", "missing"))]:
        with pytest.raises(InvalidRequestError) as caught:
            served.run(served.manager.deploy(path))
        assert str(caught.value).startswith("path: "), caught.value
        assert len(str(caught.value)) < 200
        assert status_for_exception(caught.value)[0].name == "INVALID_ARGUMENT"
    assert served.manager.registry.list() == before
    record = served.run(served.manager.deploy(str(versions["v2"])))
    assert record.state is VersionState.VALIDATED


def test_drain_with_one_weight_slot_is_refused_before_anything_happens(versions, tmp_path):
    served = Served(versions["v1"], tmp_path / "state", weight_slots="1")
    try:
        v1 = served.manager.registry.active
        served.run(served.manager.deploy(str(versions["v2"])))
        served.swap("v2", "migrate")
        assert served.manager.registry.get(v1).state is VersionState.RETIRED
        states = {v.version: v.state for v in served.manager.registry.list()}

        with pytest.raises(SwapRefusedError, match="drain needs two weight slots"):
            served.run(served.manager.rollback("drain"))
        with pytest.raises(SwapRefusedError, match="drain needs two weight slots"):
            served.swap(v1, "drain")

        # The rollback target stays retired (it used to go retired -> validated here).
        assert {v.version: v.state for v in served.manager.registry.list()} == states
        assert served.manager.registry.active == "v2"
        assert served.manager.busy == ""
    finally:
        served.close()


def test_a_commit_that_fails_leaves_the_rollback_target_retired(served, versions):
    v1 = served.manager.registry.active
    served.run(served.manager.deploy(str(versions["v2"])))
    served.swap("v2")
    served.run(served.manager.deploy(str(versions["v3"])))  # v1 leaves the standby slot
    assert v1 not in served.slots()
    states = {v.version: v.state for v in served.manager.registry.list()}
    commit = served.manager.port.commit

    def failing_commit(*args, **kwargs):
        async def events():
            raise SwapFailedError("the engine could not commit")
            yield  # an async generator, like the port's

        return events()

    served.manager.port.commit = failing_commit  # type: ignore[method-assign]
    try:
        with pytest.raises(SwapFailedError):
            served.run(served.manager.rollback())  # restages v1 from disk, then fails
    finally:
        served.manager.port.commit = commit  # type: ignore[method-assign]
    assert {v.version: v.state for v in served.manager.registry.list()} == states
    assert served.manager.registry.get(v1).state is VersionState.RETIRED
    assert served.manager.registry.previous == v1
    assert served.run(served.manager.rollback()).stage == "committed"  # and it still works
    assert served.manager.registry.active == v1


def with_config(source: Path, directory: Path, **changes: object) -> Path:
    """A copy of version `source` whose config.json has `changes`, with its own manifest."""
    shutil.copytree(source, directory)
    (directory / "manifest.json").unlink()
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    write_manifest(directory)
    return directory


def test_a_version_equal_up_to_float32_rounding_is_the_same_architecture(
    served, versions, tmp_path
):
    eps = json.loads((versions["v1"] / "config.json").read_text())["rms_norm_eps"]
    rounded = float(np.float32(eps))  # what a GGUF holds for the same model
    assert rounded != eps
    theta = json.loads((versions["v1"] / "config.json").read_text()).get("rope_theta", 10000.0)
    same = with_config(
        versions["v2"], tmp_path / "gguf-rounded", rms_norm_eps=rounded,
        rope_theta=float(np.float32(theta + 1e-4)),  # rounds to the same float32 as theta
    )  # fmt: skip
    record = served.run(served.manager.deploy(str(same)))
    assert record.state is VersionState.VALIDATED


def test_an_architecture_that_really_differs_says_which_field_and_by_how_much(
    served, versions, tmp_path
):
    eps = json.loads((versions["v1"] / "config.json").read_text())["rms_norm_eps"]
    other = with_config(versions["v2"], tmp_path / "other-eps", rms_norm_eps=eps * 1.1)
    with pytest.raises(VersionRejectedError) as caught:
        served.run(served.manager.deploy(str(other)))
    message = str(caught.value)
    assert f"rms_norm_eps {eps * 1.1!r} (serving: {eps!r}), off by " in message
    assert "(+10.000%)" in message
    assert "rope_theta" not in message  # only what differs
