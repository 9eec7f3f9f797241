# Helpers shared by the top-level build, the tests and the benchmarks.

# Warnings, sanitizers and the precompiled header for project code only (LibTorch's headers
# come in through its imported target, so they are system headers and never warn).
function(colossal_project_flags target)
  # -fPIC everywhere (not the PIE/PIC property) so one precompiled header serves libraries and
  # executables alike.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fPIC -Wall -Wextra -Wno-unused-parameter>
                         $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fPIC>)
  if(COLOSSAL_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
  if(COLOSSAL_SANITIZE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${COLOSSAL_SANITIZE} -fno-omit-frame-pointer>)
    target_link_options(${target} PRIVATE -fsanitize=${COLOSSAL_SANITIZE})
  endif()
  target_compile_definitions(${target} PRIVATE
    $<$<BOOL:${COLOSSAL_WITH_CUDA}>:COLOSSAL_WITH_CUDA=1>
    $<$<BOOL:${COLOSSAL_WITH_GLOO}>:COLOSSAL_WITH_GLOO=1>)
  if(COLOSSAL_PCH AND TARGET colossal_core AND NOT target STREQUAL "colossal_core")
    target_precompile_headers(${target} REUSE_FROM colossal_core)
  endif()
endfunction()

# colossal_layer(name dep...): src/<name>/**/*.cpp (and *.cu when CUDA is on) as the static
# library colossal_<name>. A layer with no sources yet is skipped.
set(COLOSSAL_LAYER_TARGETS "" CACHE INTERNAL "")
function(colossal_layer name)
  file(GLOB_RECURSE srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/${name}/*.cpp)
  if(COLOSSAL_WITH_CUDA)
    file(GLOB_RECURSE cu CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/${name}/*.cu)
    list(APPEND srcs ${cu})
  endif()
  if(NOT srcs)
    return()
  endif()
  add_library(colossal_${name} STATIC ${srcs})
  target_include_directories(colossal_${name} PUBLIC ${CMAKE_SOURCE_DIR}/include PRIVATE ${CMAKE_SOURCE_DIR}/src)
  target_link_libraries(colossal_${name} PUBLIC ${TORCH_LIBRARIES})
  foreach(dep ${ARGN})
    if(TARGET colossal_${dep})
      target_link_libraries(colossal_${name} PUBLIC colossal_${dep})
    endif()
  endforeach()
  if(name STREQUAL "core" AND COLOSSAL_PCH)
    target_precompile_headers(colossal_core PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${CMAKE_SOURCE_DIR}/src/pch.h>)
  endif()
  colossal_project_flags(colossal_${name})
  set(COLOSSAL_LAYER_TARGETS ${COLOSSAL_LAYER_TARGETS} colossal_${name} CACHE INTERNAL "")
endfunction()

# colossal_add_test(name SOURCES a.cpp... LIBS colossal_x... [RANKS n] [MORE_RANKS m...]
#                   [LABELS ...]): a GoogleTest executable registered with CTest. RANKS n runs it
# as n ranks under `colossal run`; MORE_RANKS registers the same binary again as name_<m>ranks
# at m ranks (one compile, several layouts).
function(colossal_add_test name)
  cmake_parse_arguments(T "" "RANKS;TIMEOUT" "SOURCES;LIBS;LABELS;ARGS;MORE_RANKS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/tests)
  colossal_project_flags(${name})
  if(T_RANKS)
    add_test(NAME ${name} COMMAND $<TARGET_FILE:colossal_cli> run --nproc_per_node ${T_RANKS}
             --master_port 0 $<TARGET_FILE:${name}> ${T_ARGS})
    set_tests_properties(${name} PROPERTIES PROCESSORS ${T_RANKS})
  else()
    add_test(NAME ${name} COMMAND ${name} ${T_ARGS})
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  set(_names ${name})
  foreach(m ${T_MORE_RANKS})
    add_test(NAME ${name}_${m}ranks COMMAND $<TARGET_FILE:colossal_cli> run --nproc_per_node ${m}
             --master_port 0 $<TARGET_FILE:${name}> ${T_ARGS})
    set_tests_properties(${name}_${m}ranks PROPERTIES PROCESSORS ${m})
    list(APPEND _names ${name}_${m}ranks)
  endforeach()
  set_tests_properties(${_names} PROPERTIES TIMEOUT ${T_TIMEOUT}
    LABELS "${T_LABELS}"
    ENVIRONMENT "COLOSSAL_BUILD_DIR=${CMAKE_BINARY_DIR};COLOSSAL_BIN=$<TARGET_FILE:colossal_cli>;COLOSSAL_SOURCE_DIR=${CMAKE_SOURCE_DIR}")
endfunction()

# colossal_add_pytest(file.py [TIMEOUT s] [DEPENDS targets...]): a pytest file run with the
# project's Python (torch, transformers and safetensors from pip) against the built binaries.
function(colossal_add_pytest file)
  cmake_parse_arguments(T "" "TIMEOUT;PROCESSORS" "LABELS" ${ARGN})
  get_filename_component(base ${file} NAME_WE)
  get_filename_component(abs ${file} ABSOLUTE)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 900)
  endif()
  if(NOT T_PROCESSORS)
    set(T_PROCESSORS 1)
  endif()
  add_test(NAME py_${base} COMMAND ${COLOSSAL_PYTHON} -m pytest -q -x -p no:cacheprovider ${abs})
  set_tests_properties(py_${base} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${T_PROCESSORS}
    LABELS "python;${T_LABELS}"
    ENVIRONMENT "COLOSSAL_BUILD_DIR=${CMAKE_BINARY_DIR};COLOSSAL_BIN=$<TARGET_FILE:colossal_cli>;COLOSSAL_SOURCE_DIR=${CMAKE_SOURCE_DIR};PYTHONDONTWRITEBYTECODE=1;OMP_NUM_THREADS=1")
endfunction()
