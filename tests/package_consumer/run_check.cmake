# ctest package_consumer: install the built tree into a scratch prefix, then configure, build and
# run tests/package_consumer against it with find_package(epmoe).
set(prefix ${BIN}/prefix)
file(REMOVE_RECURSE ${BIN})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BIN}/.. --prefix ${prefix} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SRC}/tests/package_consumer -B ${BIN}/build -G ${GENERATOR}
                        -DCMAKE_PREFIX_PATH=${prefix}
                        # the package's own compile and link flags (a sanitized libepmoe.a needs
                        # its runtime in the consumer too)
                        "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}"
                        RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BIN}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
execute_process(COMMAND ${BIN}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()
message(STATUS "package consumer: OK")
