"""The undo records' keys: the text the store holds is what it was, and what no VMM running
owns is found stale."""

from __future__ import annotations

from vmpin.reconcile.observation import VmmKey, stale_originals


def test_keys_are_the_text_they_were() -> None:
    vmm = VmmKey("sb1", 41, 9000)
    assert vmm.orig(42) == "orig-affinity:sb1:41:9000:42"
    assert vmm.orig_prefix() == "orig-affinity:sb1:41:9000:"
    assert vmm.missing() == "missing-vcpus:sb1:41:9000"


def test_stale_originals_are_those_of_vmms_gone() -> None:
    live, gone, reused = VmmKey("sb1", 41, 9000), VmmKey("sb2", 50, 100), VmmKey("sb1", 41, 9)
    keys = [live.orig(41), live.orig(42), gone.orig(50), reused.orig(41), "orig-affinity:junk"]
    assert stale_originals(keys, [live]) == [gone.orig(50), reused.orig(41), "orig-affinity:junk"]
    assert stale_originals(keys, [live, gone, reused]) == ["orig-affinity:junk"]
