"""baton.settings: environment parsing, token files, validation."""

import dataclasses

import pytest

from baton.settings import DEFAULT_MAX_MESSAGE_BYTES, Settings, SettingsError, read_token_file


def test_defaults_from_empty_env():
    s = Settings.from_env({})
    assert s == Settings()
    assert s.token is None and s.host == "127.0.0.1" and not s.tls_enabled
    assert s.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 64 * 1024 * 1024
    assert s.log_level == "INFO" and s.log_json is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.host = "0.0.0.0"


def test_env_values_and_overrides(tmp_path):
    env = {
        "BATON_TOKEN": " abc \n",
        "BATON_HOST": "0.0.0.0",
        "BATON_MAX_MESSAGE_BYTES": "1048576",
        "BATON_LOG_LEVEL": "debug",
        "BATON_LOG_JSON": "yes",
        "BATON_TLS_CERT": "/c.pem",
        "BATON_TLS_KEY": "/k.pem",
        "BATON_TLS_CA": "/ca.pem",
    }
    s = Settings.from_env(env)
    assert (s.token, s.host, s.max_message_bytes, s.log_level, s.log_json) == ("abc", "0.0.0.0", 1 << 20, "DEBUG", True)
    assert s.tls_enabled and s.tls_ca == "/ca.pem"
    o = Settings.from_env(env, host="10.0.0.1", token=None, log_json=False)
    assert o.host == "10.0.0.1" and o.token == "abc" and o.log_json is False  # None = not given
    assert o.replace(token=None).token is None
    with pytest.raises(TypeError):
        Settings.from_env({}, no_such_field=1)
    assert Settings.from_env({"BATON_SWITCH_INTERVAL_US": "700"}).switch_interval_us == 700


def test_token_file(tmp_path):
    f = tmp_path / "tok"
    f.write_text("  from-file\n")
    assert read_token_file(f) == "from-file"
    assert Settings.from_env({"BATON_TOKEN_FILE": str(f)}).token == "from-file"
    # BATON_TOKEN wins over the file
    assert Settings.from_env({"BATON_TOKEN_FILE": str(f), "BATON_TOKEN": "env"}).token == "env"
    f.write_text(" \n\t")
    with pytest.raises(SettingsError, match="empty"):
        Settings.from_env({"BATON_TOKEN_FILE": str(f)})
    with pytest.raises(SettingsError, match="BATON_TOKEN_FILE"):
        read_token_file(tmp_path / "missing")


@pytest.mark.parametrize(
    "env, field",
    [
        ({"BATON_MAX_MESSAGE_BYTES": "lots"}, "BATON_MAX_MESSAGE_BYTES"),
        ({"BATON_MAX_MESSAGE_BYTES": "0"}, "BATON_MAX_MESSAGE_BYTES"),
        ({"BATON_LOG_JSON": "maybe"}, "BATON_LOG_JSON"),
        ({"BATON_TLS_CERT": "/c.pem"}, "BATON_TLS_KEY"),
        ({"BATON_TOKEN": "   "}, "BATON_TOKEN"),
        ({"BATON_SWITCH_INTERVAL_US": "0"}, "BATON_SWITCH_INTERVAL_US"),
    ],
)
def test_bad_values_name_the_variable(env, field):
    with pytest.raises(SettingsError, match=field):
        Settings.from_env(env)


def test_handoff_tail_settings_env_and_cli(capsys, monkeypatch):
    """Wire format 4's tail segment: BATON_HANDOFF_TAIL_CHUNK_BYTES (0 = off, default 1 MiB) and
    BATON_HANDOFF_TAIL_LAYERS (default 1); the prefill worker caps the tail's chunks at --chunk-mib."""
    assert (Settings().handoff_tail_chunk_bytes, Settings().handoff_tail_layers) == (1 << 20, 1)
    s = Settings.from_env({"BATON_HANDOFF_TAIL_CHUNK_BYTES": " 1048576 ", "BATON_HANDOFF_TAIL_LAYERS": "0"})
    assert (s.handoff_tail_chunk_bytes, s.handoff_tail_layers) == (1 << 20, 0)
    assert Settings.from_env({"BATON_HANDOFF_TAIL_CHUNK_BYTES": ""}).handoff_tail_chunk_bytes == 1 << 20
    assert Settings.from_env({"BATON_HANDOFF_TAIL_CHUNK_BYTES": "0"}).handoff_tail_chunk_bytes == 0
    for env, field in [
        ({"BATON_HANDOFF_TAIL_CHUNK_BYTES": "-1"}, "BATON_HANDOFF_TAIL_CHUNK_BYTES: must be >= 0"),
        ({"BATON_HANDOFF_TAIL_CHUNK_BYTES": "1M"}, "BATON_HANDOFF_TAIL_CHUNK_BYTES: expected an integer"),
        ({"BATON_HANDOFF_TAIL_LAYERS": "-2"}, "BATON_HANDOFF_TAIL_LAYERS: must be >= 0"),
    ]:
        with pytest.raises(SettingsError, match=field):
            Settings.from_env(env)
    with pytest.raises(SettingsError, match="BATON_HANDOFF_TAIL_CHUNK_BYTES"):
        Settings(handoff_tail_chunk_bytes=1.5)
    import prefill_worker.__main__ as cli
    from prefill_worker.service import check_tail_chunk_bytes

    monkeypatch.setattr(cli, "setup_logging", lambda settings: None)  # NOTE: no basicConfig in the test process
    main = cli.main

    assert check_tail_chunk_bytes(Settings(handoff_tail_chunk_bytes=1 << 20), 1 << 20) == 1 << 20
    assert check_tail_chunk_bytes(Settings(handoff_tail_chunk_bytes=2 << 20), 1 << 20) == 1 << 20
    assert check_tail_chunk_bytes(Settings(), 64 << 10) == 64 << 10
    # refused at start-up, before any model loads
    assert main(["--port", "0", "--handoff-tail-chunk-mib", "-1"]) == 2
    assert "BATON_HANDOFF_TAIL_CHUNK_BYTES" in capsys.readouterr().err
