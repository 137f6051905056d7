# Installs the build into a scratch prefix, then configures, builds and runs a downstream
# project that only knows find_package(fusedloss).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
file(REMOVE_RECURSE ${BUILD_ROOT})
run(${CMAKE_COMMAND} --install ${FUSEDLOSS_BUILD} --prefix ${BUILD_ROOT}/prefix)
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_ROOT}/build
    -DCMAKE_PREFIX_PATH=${BUILD_ROOT}/prefix)
run(${CMAKE_COMMAND} --build ${BUILD_ROOT}/build)
run(${BUILD_ROOT}/build/consumer)
