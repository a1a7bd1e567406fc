# kiln's GGUF exports read by llama.cpp's own Python reader (the gguf package from PyPI,
# in build/venv, which scripts/install-test-deps.sh makes): header keys, every tensor
# dequantized against the Hugging Face weights it came from, rope scaling, and a
# SentencePiece-style vocabulary. Exit code 77 is a skip (a package missing), never a pass.
if(KILN_PYTHON3)
  add_test(NAME gguf_reader COMMAND sh -c "py=${CMAKE_SOURCE_DIR}/build/venv/bin/python; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/gguf/test_gguf_reader.py --kiln $<TARGET_FILE:kiln_tool>
           --src ${CMAKE_SOURCE_DIR} --workdir ${CMAKE_BINARY_DIR}/gguf-tests)
  set_tests_properties(gguf_reader PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()

# kiln's GGUF reader against llama.cpp's: every tensor type kiln reads, dequantized bit
# for bit as the gguf package dequantizes it, the metadata of every value type, and
# malformed files refused by name (tests/gguf/test_gguf_read.py, through gguf_probe).
add_executable(gguf_probe ${CMAKE_CURRENT_LIST_DIR}/gguf_probe.c)
target_link_libraries(gguf_probe PRIVATE kiln)
if(KILN_PYTHON3)
  add_test(NAME gguf_read COMMAND sh -c "py=${CMAKE_SOURCE_DIR}/build/venv/bin/python; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/gguf/test_gguf_read.py --probe $<TARGET_FILE:gguf_probe> --kiln $<TARGET_FILE:kiln_tool>
           --workdir ${CMAKE_BINARY_DIR}/gguf-read-tests)
  set_tests_properties(gguf_read PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()

# GGUF files as models: written here from the Hugging Face reference folders as
# llama.cpp's converter writes them (the gguf package, every quantized type), loaded by
# kiln_model_load (gguf_logits), their logits against transformers' (tests/gguf/test_gguf_load.py).
add_executable(gguf_logits ${CMAKE_CURRENT_LIST_DIR}/gguf_logits.c)
target_link_libraries(gguf_logits PRIVATE kiln)
add_executable(quant_probe ${CMAKE_CURRENT_LIST_DIR}/quant_probe.c)
target_include_directories(quant_probe PRIVATE ${CMAKE_SOURCE_DIR}/src)
target_link_libraries(quant_probe PRIVATE kiln)
if(KILN_PYTHON3)
  add_test(NAME gguf_load COMMAND sh -c "py=${CMAKE_SOURCE_DIR}/build/venv/bin/python; [ -x \"$py\" ] || py=${KILN_PYTHON3}; exec \"$py\" \"$@\"" sh
           ${CMAKE_SOURCE_DIR}/tests/gguf/test_gguf_load.py --logits $<TARGET_FILE:gguf_logits>
           --kiln $<TARGET_FILE:kiln_tool> --quant $<TARGET_FILE:quant_probe> --src ${CMAKE_SOURCE_DIR}
           --workdir ${CMAKE_BINARY_DIR}/gguf-load-tests)
  set_tests_properties(gguf_load PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()
