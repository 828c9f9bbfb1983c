# Fails unless every symbol libdevbridge_c.so defines for the dynamic linker
# is a devbridge_ function (src/c_api/exports.map): no C++ symbol of ours or
# of the standard library may leak into a C caller's namespace.
execute_process(COMMAND ${NM} -D --defined-only ${LIBRARY} OUTPUT_VARIABLE symbols RESULT_VARIABLE nm_result)
if(NOT nm_result EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIBRARY} failed (${nm_result})")
endif()
string(REPLACE "\n" ";" lines "${symbols}")
set(count 0)
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  # "<address> <type> <name>[@@version]"
  if(NOT line MATCHES "^[0-9a-fA-F]+ T devbridge_[a-z0-9_]+$")
    message(FATAL_ERROR "libdevbridge_c.so exports a symbol that is not a devbridge_ function: ${line}")
  endif()
  math(EXPR count "${count} + 1")
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "libdevbridge_c.so exports nothing")
endif()
message(STATUS "libdevbridge_c.so exports ${count} devbridge_ functions and nothing else")
