"""The daemon's admin token: created once in the state dir (0600), reused, or read from a file."""

from __future__ import annotations

import logging

import pytest

from sitsd.config import ServerConfig
from sitsd.daemon import load_or_create_admin_token


def test_token_is_created_private_in_the_state_dir_and_reused(tmp_path):
    state_dir = tmp_path / "state" / "nested"
    token, path = load_or_create_admin_token(ServerConfig(state_dir=str(state_dir)))

    assert path == state_dir / "admin-token"
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(token) >= 32
    assert path.read_text().strip() == token
    again, _ = load_or_create_admin_token(ServerConfig(state_dir=str(state_dir)))
    assert again == token
    assert list(state_dir.iterdir()) == [path]  # no temporary file left behind


def test_two_state_dirs_get_different_tokens(tmp_path):
    first, _ = load_or_create_admin_token(ServerConfig(state_dir=str(tmp_path / "a")))
    second, _ = load_or_create_admin_token(ServerConfig(state_dir=str(tmp_path / "b")))
    assert first != second


def test_explicit_token_file_wins_and_is_never_created(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret \n")
    token_file.chmod(0o600)
    config = ServerConfig(admin_token_file=str(token_file), state_dir=str(tmp_path / "state"))
    assert load_or_create_admin_token(config) == ("s3cret", token_file)
    assert not (tmp_path / "state").exists()

    with pytest.raises(FileNotFoundError):
        load_or_create_admin_token(ServerConfig(admin_token_file=str(tmp_path / "missing")))


def test_empty_token_file_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_or_create_admin_token(ServerConfig(admin_token_file=str(token_file)))


def test_no_state_dir_and_no_token_file_is_refused():
    with pytest.raises(ValueError, match="--state-dir"):
        load_or_create_admin_token(ServerConfig())


def test_token_file_readable_by_others_is_warned_about(tmp_path, caplog):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    token_file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="sitsd.daemon"):
        load_or_create_admin_token(ServerConfig(admin_token_file=str(token_file)))
    assert "readable by other users" in caplog.text
