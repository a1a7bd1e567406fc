# kiln's tokenizer against the tokenizers library (PyPI, in build/venv, which
# scripts/install-test-deps.sh makes): GPT-2, LLaMA-3 and Qwen2 shapes on a multilingual
# text. Exit code 77 is a skip (the package missing), never a pass.
if(KILN_PYTHON3)
  add_test(NAME hf_tokenizers COMMAND sh -c "py=${CMAKE_SOURCE_DIR}/build/venv/bin/python; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/tokenizer/test_hf_tokenizers.py --kiln $<TARGET_FILE:kiln_tool>
           --workdir ${CMAKE_BINARY_DIR}/tokenizer-tests)
  set_tests_properties(hf_tokenizers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
