# kiln's tokenizer against the tokenizers library (PyPI, in build/venv, which
# scripts/install-test-deps.sh makes): GPT-2, LLaMA-3, Qwen2 and LLaMA-2 (SentencePiece-
# style) shapes on a multilingual text, and kiln's saved files read back by tokenizers
# (through tokenizer_resave). Exit code 77 is a skip (the package missing), never a pass.
add_executable(tokenizer_resave ${CMAKE_CURRENT_LIST_DIR}/resave.c)
target_link_libraries(tokenizer_resave PRIVATE kiln)
if(KILN_PYTHON3)
  add_test(NAME hf_tokenizers COMMAND sh -c "py=${CMAKE_SOURCE_DIR}/build/venv/bin/python; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/tokenizer/test_hf_tokenizers.py --kiln $<TARGET_FILE:kiln_tool>
           --resave $<TARGET_FILE:tokenizer_resave> --workdir ${CMAKE_BINARY_DIR}/tokenizer-tests)
  set_tests_properties(hf_tokenizers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
