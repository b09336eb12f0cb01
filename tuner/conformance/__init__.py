"""Conformance with the pinned real vLLM: the probes, their answers reduced to shapes, the recorder, the comparison.

The recorder (`scripts/record-vllm-conformance`) writes tests/emulator/fixtures/vllm-<pin>/ from a real server; the
fast suite runs the same probes on the emulator and compares (tests/emulator/test_emulator_conformance.py); the real
tier re-records into a temporary directory and compares with the committed fixtures
(tests/conformance/test_conformance_real.py).
"""
