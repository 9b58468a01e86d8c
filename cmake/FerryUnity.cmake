# CI's build (FERRY_CI_BUILD): CUDA sources compiled a few to a translation unit. Through nvcc the headers a source
# includes (the device views, GoogleTest, the standard library) cost more than its own code, and CMake's UNITY_BUILD
# does not cover CUDA. Each unit only #includes its sources; a source's names in anonymous namespaces must not
# clash with those of the others in its unit (the library's and the tests' sources are written so).

# ferry_unity_sources(OUT NAME BATCH SOURCE...): OUT = the files BINARY_DIR/NAME_<i>.cu, each including BATCH of the
# sources in their order (rewritten only when their list changes).
function(ferry_unity_sources out name batch)
  set(files)
  set(content "")
  set(count 0)
  list(LENGTH ARGN total)
  set(done 0)
  foreach(source ${ARGN})
    string(APPEND content "#include \"${source}\"\n")
    math(EXPR count "${count} + 1")
    math(EXPR done "${done} + 1")
    if(count EQUAL batch OR done EQUAL total)
      list(LENGTH files index)
      set(file ${CMAKE_CURRENT_BINARY_DIR}/${name}_${index}.cu)
      file(CONFIGURE OUTPUT ${file} CONTENT "// FERRY_CI_BUILD: made by cmake/FerryUnity.cmake\n${content}")
      list(APPEND files ${file})
      set(content "")
      set(count 0)
    endif()
  endforeach()
  set(${out} ${files} PARENT_SCOPE)
endfunction()
