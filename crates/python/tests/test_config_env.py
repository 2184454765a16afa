"""One name per setting (issue 34): the master address is ``KVPOOL_MASTER`` in the Python
package, as in the agent and the conductor; ``KVPOOL_MASTER_ADDR``, its old name, is still read
when the new one is unset, with a ``DeprecationWarning`` and one logged warning. No pool
needed: only how the settings resolve."""

from __future__ import annotations

import logging
import warnings

import pytest

from kvpool import _config, adapters


@pytest.fixture(autouse=True)
def log_again(monkeypatch):
    # Each test sees the once-per-process log line.
    monkeypatch.setattr(_config, "_master_alias_logged", False)


def resolve(env: dict) -> _config.Settings:
    return _config.Settings.resolve(env=env, auth_key_file="/k", mode="direct")


def test_the_one_name_is_read_without_a_warning():
    assert _config.ENV_MASTER == "KVPOOL_MASTER"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve({"KVPOOL_MASTER": "m-0:1, m-1:2"}).masters == ["m-0:1", "m-1:2"]
        args = adapters.setup_args(environ={"KVPOOL_MASTER": "m-0:1", "KVPOOL_POD_IP": "1.2.3.4"})
    assert args.master_server_addr == "m-0:1"


def test_the_old_name_still_works_and_warns(caplog):
    caplog.set_level(logging.WARNING, logger="kvpool")
    with pytest.warns(DeprecationWarning, match="KVPOOL_MASTER_ADDR is deprecated.*KVPOOL_MASTER"):
        assert resolve({"KVPOOL_MASTER_ADDR": "old:1"}).masters == ["old:1"]
    with pytest.warns(DeprecationWarning, match="KVPOOL_MASTER_ADDR"):
        args = adapters.setup_args(environ={"KVPOOL_MASTER_ADDR": "old:1", "KVPOOL_POD_IP": "x"})
    assert args.master_server_addr == "old:1"
    logged = [r for r in caplog.records if "KVPOOL_MASTER_ADDR is deprecated" in r.getMessage()]
    assert len(logged) == 1, "the log says it once per process"


def test_the_new_name_wins_and_silences_the_old_one():
    env = {"KVPOOL_MASTER": "new:1", "KVPOOL_MASTER_ADDR": "old:1", "KVPOOL_POD_IP": "x"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(env).masters == ["new:1"]
        assert adapters.setup_args(environ=env).master_server_addr == "new:1"


def test_a_missing_master_names_the_new_variable():
    with pytest.raises(_config.ConfigError, match="KVPOOL_MASTER or"):
        resolve({"KVPOOL_MASTER": " "})
    with pytest.raises(adapters.ConfigError, match="set KVPOOL_MASTER,"):
        adapters.setup_args(environ={"KVPOOL_POD_IP": "x"})
