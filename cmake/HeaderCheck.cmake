# colossal_header_check: every public header under include/colossal/ compiled on its own, in its
# own translation unit and WITHOUT the precompiled header (which supplies ATen, torch/nn and the
# std containers to every project file, and so hides a header that leans on an include it does
# not make). Each generated source includes its header twice (the second must be a no-op:
# #pragma once). Part of the default build, so `make test` and CI fail on a header that does not
# stand alone. Only parsing costs: no code is emitted from an include alone, hence -O0.
option(COLOSSAL_HEADER_CHECK "Build colossal_header_check (each public header compiled alone)" ON)
if(COLOSSAL_HEADER_CHECK)
  file(GLOB_RECURSE _colossal_headers CONFIGURE_DEPENDS RELATIVE ${CMAKE_SOURCE_DIR}/include
       ${CMAKE_SOURCE_DIR}/include/colossal/*.h)
  set(_colossal_header_srcs "")
  foreach(_h ${_colossal_headers})
    string(REGEX REPLACE "[/.]" "_" _stem ${_h})
    set(_src ${CMAKE_BINARY_DIR}/header_check/${_stem}.cpp)
    # file(CONFIGURE) rewrites the file only when its content changes (no needless rebuilds).
    file(CONFIGURE OUTPUT ${_src} CONTENT "#include \"${_h}\"\n#include \"${_h}\"\n")
    list(APPEND _colossal_header_srcs ${_src})
  endforeach()
  add_library(colossal_header_check OBJECT ${_colossal_header_srcs})
  target_include_directories(colossal_header_check PRIVATE ${CMAKE_SOURCE_DIR}/include)
  # LibTorch's usage requirements (its include directories, as system headers, and its flags).
  target_link_libraries(colossal_header_check PRIVATE ${TORCH_LIBRARIES})
  # The project's warnings and definitions (colossal_project_flags without the PCH).
  target_compile_options(colossal_header_check PRIVATE -O0 -Wall -Wextra -Wno-unused-parameter
                         $<$<BOOL:${COLOSSAL_WERROR}>:-Werror>)
  target_compile_definitions(colossal_header_check PRIVATE
    $<$<BOOL:${COLOSSAL_WITH_CUDA}>:COLOSSAL_WITH_CUDA=1>
    $<$<BOOL:${COLOSSAL_WITH_GLOO}>:COLOSSAL_WITH_GLOO=1>)
endif()
