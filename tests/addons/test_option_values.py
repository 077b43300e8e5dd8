"""The option values the addons parse themselves (addons/option_values.py): one rule each,
refused with an error that names the option."""

import pytest
from mitmproxy import exceptions

from polar_mitm.addons import option_values


@pytest.mark.parametrize("text, value", [("0", 0.0), ("0.3", 0.3), ("3600", 3600.0)])
def test_seconds_options_take_zero_to_an_hour(text, value):
    assert option_values.seconds("polar_stream_keepalive", text) == value


@pytest.mark.parametrize("text", ["-1", "3601", "nan", "inf", "soon", ""])
def test_seconds_options_refuse_the_rest_and_name_the_option(text):
    with pytest.raises(exceptions.OptionsError, match=r"^polar_version_check: seconds from 0 \(off\) to 3600"):
        option_values.seconds("polar_version_check", text)


def test_size_and_integer_options_name_the_option():
    assert option_values.size("polar_max_body", "2m") == 2 << 20
    assert option_values.integer("polar_policy_version", "7") == 7
    for parse, name, bad in ((option_values.size, "polar_max_body", "lots"), (option_values.size, "polar_max_body", "0"),
                             (option_values.integer, "polar_policy_version", "1.5")):
        with pytest.raises(exceptions.OptionsError, match=f"^{name}: expected"):
            parse(name, bad)
