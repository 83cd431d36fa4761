from semverlite import compare


def test_equal_versions():
    assert compare("1.2.3", "1.2.3") == 0


def test_patch_level_ordering():
    assert compare("1.2.3", "1.2.4") == -1


def test_prerelease_sorts_before_release():
    assert compare("1.0.0-rc.1", "1.0.0") == -1
    assert compare("1.0.0", "1.0.0-rc.1") == 1


def test_prereleases_are_ordered():
    assert compare("1.0.0-alpha", "1.0.0-beta") == -1
