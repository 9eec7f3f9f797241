# colossal_header_check: every public header under include/colossal/ compiled on its own, in its
# own translation unit, without the project's precompiled header (which supplies ATen, torch/nn
# and the std containers to every project file, and so hides a header that leans on an include
# it does not make). Each generated source includes its header twice (the second must be a
# no-op: #pragma once). Part of the default build, so `make test` and CI fail on a header that
# does not stand alone. No code is emitted from an include alone, hence -O0.
#
# Cost: parsing LibTorch is nearly all of it (ATen/core/Tensor.h ~3 s, torch/nn/module.h ~20 s
# per translation unit). So each header is checked against a precompiled copy of the one heavy
# LibTorch header its own include closure reaches anyway (torch/nn/module.h, else
# ATen/core/Tensor.h, else none), found by scanning the #include lines below. That hides
# nothing: a header whose closure lacks the heavy header gets no such help, and one whose
# closure has it would see the same declarations without the copy. (The one thing it cannot see:
# a header that uses a LibTorch name above the #include that brings it.)
option(COLOSSAL_HEADER_CHECK "Build colossal_header_check (each public header compiled alone)" ON)

# The heaviest LibTorch header reachable from include/<rel> through project headers:
# 2 = <torch/nn/module.h>, 1 = <ATen/core/Tensor.h>, 0 = neither (memoised per header).
function(colossal_header_tier rel out)
  string(MAKE_C_IDENTIFIER "${rel}" _key)
  get_property(_tier GLOBAL PROPERTY COLOSSAL_HEADER_TIER_${_key})
  if(NOT "${_tier}" STREQUAL "")
    set(${out} ${_tier} PARENT_SCOPE)
    return()
  endif()
  set(_tier 0)
  file(STRINGS ${CMAKE_SOURCE_DIR}/include/${rel} _lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
  foreach(_line IN LISTS _lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]+)[>\"].*" "\\1" _inc "${_line}")
    set(_sub 0)
    if(_inc STREQUAL "torch/nn/module.h")
      set(_sub 2)
    elseif(_inc STREQUAL "ATen/core/Tensor.h")
      set(_sub 1)
    elseif(_inc MATCHES "^colossal/" AND EXISTS ${CMAKE_SOURCE_DIR}/include/${_inc})
      colossal_header_tier(${_inc} _sub)
    endif()
    if(_sub GREATER _tier)
      set(_tier ${_sub})
    endif()
  endforeach()
  set_property(GLOBAL PROPERTY COLOSSAL_HEADER_TIER_${_key} ${_tier})
  set(${out} ${_tier} PARENT_SCOPE)
endfunction()

if(COLOSSAL_HEADER_CHECK)
  file(GLOB_RECURSE _colossal_headers CONFIGURE_DEPENDS RELATIVE ${CMAKE_SOURCE_DIR}/include
       ${CMAKE_SOURCE_DIR}/include/colossal/*.h)
  set(_hc_srcs_0 "")
  set(_hc_srcs_1 "")
  set(_hc_srcs_2 "")
  foreach(_h ${_colossal_headers})
    string(REGEX REPLACE "[/.]" "_" _stem ${_h})
    set(_src ${CMAKE_BINARY_DIR}/header_check/${_stem}.cpp)
    # file(CONFIGURE) rewrites the file only when its content changes (no needless rebuilds).
    file(CONFIGURE OUTPUT ${_src} CONTENT "#include \"${_h}\"\n#include \"${_h}\"\n")
    colossal_header_tier(${_h} _tier)
    list(APPEND _hc_srcs_${_tier} ${_src})
  endforeach()
  add_custom_target(colossal_header_check ALL)
  set(_hc_pch_1 <ATen/core/Tensor.h>)
  set(_hc_pch_2 <torch/nn/module.h>)
  foreach(_tier 0 1 2)
    if(NOT _hc_srcs_${_tier})
      continue()
    endif()
    set(_t colossal_header_check_${_tier})
    add_library(${_t} OBJECT ${_hc_srcs_${_tier}})
    target_include_directories(${_t} PRIVATE ${CMAKE_SOURCE_DIR}/include)
    # LibTorch's usage requirements (its include directories, as system headers, and its flags).
    target_link_libraries(${_t} PRIVATE ${TORCH_LIBRARIES})
    # The project's warnings and definitions (colossal_project_flags without the project PCH).
    target_compile_options(${_t} PRIVATE -O0 -Wall -Wextra -Wno-unused-parameter
                           $<$<BOOL:${COLOSSAL_WERROR}>:-Werror>)
    target_compile_definitions(${_t} PRIVATE
      $<$<BOOL:${COLOSSAL_WITH_CUDA}>:COLOSSAL_WITH_CUDA=1>
      $<$<BOOL:${COLOSSAL_WITH_GLOO}>:COLOSSAL_WITH_GLOO=1>)
    if(_tier GREATER 0)
      target_precompile_headers(${_t} PRIVATE ${_hc_pch_${_tier}})
    endif()
    add_dependencies(colossal_header_check ${_t})
  endforeach()
endif()
