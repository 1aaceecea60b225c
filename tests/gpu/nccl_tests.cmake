# NCCL communicator suites (label gpu; they skip, and say why, without one GPU per rank).
# Included from tests/gpu/CMakeLists.txt: include(${CMAKE_CURRENT_SOURCE_DIR}/nccl_tests.cmake)
if(EPMOE_ENABLE_NCCL AND EPMOE_ENABLE_MPI)
  epmoe_mpi_test(test_nccl_comm NP 2 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_nccl_comm.cpp LABELS gpu)
  epmoe_mpi_test(test_nccl_peer_death NP 2 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_nccl_peer_death.cpp LABELS gpu)
endif()
