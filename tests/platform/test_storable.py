"""common.storable: the NUL rule for what the database keeps (PostgreSQL's text and jsonb cannot hold it)."""

from common.storable import holds_nul, storable


def test_every_nul_in_strings_keys_and_lists_becomes_u_fffd():
    value = {"a\x00": ["x\x00y", {"k": "\x00\x00"}], "n": 3, "none": None, "ok": "plain"}
    assert storable(value) == {"a\ufffd": ["x\ufffdy", {"k": "\ufffd\ufffd"}], "n": 3, "none": None, "ok": "plain"}
    assert storable("no nul") == "no nul"


def test_holds_nul_looks_everywhere():
    assert holds_nul({"k": [1, {"deep": "a\x00"}]})
    assert holds_nul({"\x00": 1})
    assert not holds_nul({"k": [1, {"deep": "a\ufffd"}], "n": None})
