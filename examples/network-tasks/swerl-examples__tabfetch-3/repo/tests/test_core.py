from tabfetch import parse_table


def test_parse_table_keys_rows_by_header():
    rows = parse_table("code\tname\nLIS\tLisbon\nOPO\tPorto\n")
    assert rows == [{"code": "LIS", "name": "Lisbon"}, {"code": "OPO", "name": "Porto"}]


def test_parse_table_skips_blank_lines():
    assert parse_table("code\tname\n\nLIS\tLisbon\n\n") == [{"code": "LIS", "name": "Lisbon"}]


def test_parse_table_of_empty_text_is_empty():
    assert parse_table("") == []
