from moebalance import runtime


def test_hugepage_env_adds_the_tunable_once(monkeypatch):
    monkeypatch.setattr(runtime, "_glibc_supports_hugetlb", lambda: True)
    assert runtime.hugepage_malloc_env({"PATH": "/bin"}) == {
        "PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert runtime.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert runtime.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None


def test_no_reexec_without_a_glibc_that_has_the_tunable(monkeypatch):
    monkeypatch.setattr(runtime, "_glibc_supports_hugetlb", lambda: False)
    assert runtime.hugepage_malloc_env({}) is None


def test_glibc_version_is_read(monkeypatch):
    monkeypatch.setattr(runtime.os, "confstr", lambda name: "glibc 2.34")
    assert not runtime._glibc_supports_hugetlb()
    monkeypatch.setattr(runtime.os, "confstr", lambda name: "glibc 2.36")
    assert runtime._glibc_supports_hugetlb()
