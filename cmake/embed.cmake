# Embeds a file's bytes in a target as a NUL-terminated C array, at build time:
#
#   include(cmake/embed.cmake)
#   kiln_embed(kiln kiln__opencl_kernel_source src/backends/opencl/kernels.cl)
#
# gives the target a generated C file defining `const char kiln__opencl_kernel_source[]`
# and its length in bytes without the NUL, `const unsigned long kiln__opencl_kernel_source_len`
# (declare them `extern` where they are used). The
# file is regenerated when the embedded one changes. The conversion is this same file
# run as a CMake script (cmake -P), so the build needs nothing beyond CMake: no xxd,
# and no #embed (not in GCC 12).

if(CMAKE_SCRIPT_MODE_FILE)
  # Script mode: -DIN=<file> -DOUT=<C file> -DSYMBOL=<name>. The bytes are written as
  # hex escapes in string literals, sixteen a line: a string literal ends in the NUL,
  # and escapes need no cast for bytes above 0x7f where char is signed.
  file(READ "${IN}" hex HEX)
  string(LENGTH "${hex}" n)
  math(EXPR n "${n} / 2")
  string(REPEAT "[0-9a-f]" 32 line)
  string(REGEX REPLACE "(${line})" "\\1\n" hex "${hex}")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "\\\\x\\1" hex "${hex}")
  string(REGEX REPLACE "\n" "\"\n    \"" literal "${hex}")
  get_filename_component(name "${IN}" NAME)
  file(WRITE "${OUT}"
       "/* Generated from ${name} by cmake/embed.cmake: edit ${name}, not this file. */\n"
       "const char ${SYMBOL}[] =\n    \"${literal}\";\n"
       "const unsigned long ${SYMBOL}_len = ${n};\n")
  return()
endif()

set(KILN_EMBED_SCRIPT "${CMAKE_CURRENT_LIST_FILE}")

# kiln_embed(<target> <symbol> <file>): <file> relative to the source directory.
function(kiln_embed target symbol file)
  get_filename_component(in "${file}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
  set(out "${CMAKE_CURRENT_BINARY_DIR}/embed/${symbol}.c")
  add_custom_command(
    OUTPUT "${out}"
    COMMAND "${CMAKE_COMMAND}" -DIN=${in} -DOUT=${out} -DSYMBOL=${symbol} -P "${KILN_EMBED_SCRIPT}"
    DEPENDS "${in}" "${KILN_EMBED_SCRIPT}"
    COMMENT "Embedding ${file} as ${symbol}"
    VERBATIM)
  target_sources(${target} PRIVATE "${out}")
endfunction()
