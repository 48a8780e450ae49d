# cmake -DNM=<nm> -DLEVEL=<level> -DOBJECTS=<a;b> -P check_cpu_symbols.cmake
#
# Fails when an object of the CPU kernels compiled for LEVEL defines a global symbol outside
# namespace kda::cpu::LEVEL (src/cpu/isa.h): such a symbol (an inline function of a header, a
# template instance) would be merged at link time with the copy another level compiled, and code
# for one instruction set could then run on a CPU without it.
cmake_policy(VERSION 3.24)
if(NOT NM OR NOT LEVEL OR NOT OBJECTS)
  message(FATAL_ERROR "usage: cmake -DNM=<nm> -DLEVEL=<level> -DOBJECTS=<objects> -P ${CMAKE_SCRIPT_MODE_FILE}")
endif()
set(bad "")
foreach(obj ${OBJECTS})
  execute_process(COMMAND ${NM} -C --defined-only --extern-only ${obj}
                  OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  foreach(line ${lines})
    # "<address> <type> <name>"; the exception-handling personality reference is harmless.
    if(line STREQUAL "" OR line MATCHES "DW\\.ref\\.__gxx_personality_v0$")
      continue()
    endif()
    if(NOT line MATCHES "kda::cpu::${LEVEL}::")
      list(APPEND bad "${obj}: ${line}")
    endif()
  endforeach()
endforeach()
list(LENGTH OBJECTS n)
if(bad)
  list(JOIN bad "\n  " text)
  message(FATAL_ERROR "global symbols outside kda::cpu::${LEVEL}::\n  ${text}")
endif()
message(STATUS "${n} objects of level ${LEVEL}: every global symbol is in kda::cpu::${LEVEL}")
