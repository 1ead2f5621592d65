"""`import deep_ep` served by moerl_ep, to run DeepEP's own test scripts unchanged:

    PYTHONPATH=build/python:tests/python/deep_ep_shim python3 DeepEP/tests/test_intranode.py ...
"""
from moerl_ep import Buffer, Config, EventOverlap  # noqa: F401
from moerl_ep.utils import EventHandle  # noqa: F401
