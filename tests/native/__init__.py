"""Sources and harness of the native kit's tests."""
