// Launch-variable parsing for torchrun, OpenMPI and SLURM (no processes started).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>

#include "colossal/core/error.h"
#include "colossal/dist/communicator.h"
#include "colossal/dist/env.h"

namespace colossal::dist {
namespace {

using Vars = std::map<std::string, std::string>;

LaunchEnv parse(const Vars& vars) {
  return parse_launch_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

// The error must be an InputError and mention `needle` (usually the variable's name).
void expect_input_error(const Vars& vars, const std::string& needle) {
  try {
    parse(vars);
    FAIL() << "no error; expected one naming " << needle;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

const Vars kMaster = {{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};

Vars with(Vars v, const Vars& more) {
  for (auto& [k, x] : more) v[k] = x;
  return v;
}

TEST(LaunchEnv, NothingSetIsOneProcess) {
  auto e = parse({});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.source, "default");
  EXPECT_TRUE(e.master_addr.empty());
}

TEST(LaunchEnv, Torchrun) {
  auto e = parse(
      with(kMaster,
           {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}}));
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_FALSE(e.agent_store);
  auto a = parse(with(kMaster, {{"RANK", "0"},
                                {"WORLD_SIZE", "2"},
                                {"LOCAL_RANK", "0"},
                                {"TORCHELASTIC_USE_AGENT_STORE", "True"}}));
  EXPECT_TRUE(a.agent_store);
  EXPECT_EQ(a.local_world_size, -1);
  // World of one needs no rendezvous address.
  auto one = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(one.world_size, 1);
}

TEST(LaunchEnv, TorchrunErrorsNameTheVariable) {
  expect_input_error(with(kMaster, {{"RANK", "0"}, {"LOCAL_RANK", "0"}}), "WORLD_SIZE");
  expect_input_error(with(kMaster, {{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}), "RANK");
  expect_input_error(with(kMaster, {{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
                     "RANK=2");
  expect_input_error(with(kMaster, {{"RANK", "x1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
                     "RANK='x1'");
  expect_input_error(with(kMaster, {{"RANK", "1"}, {"WORLD_SIZE", "2"}}), "LOCAL_RANK");
  expect_input_error(
      with(kMaster,
           {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
      "LOCAL_RANK=2");
  expect_input_error(
      with(kMaster,
           {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "3"}}),
      "LOCAL_WORLD_SIZE=3");
  expect_input_error(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_PORT", "1"}},
      "MASTER_ADDR");
  expect_input_error(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}},
      "MASTER_PORT");
  expect_input_error(
      with(kMaster,
           {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_PORT", "70000"}}),
      "MASTER_PORT=70000");
  expect_input_error(with(kMaster, {{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE");
}

TEST(LaunchEnv, OpenMpi) {
  auto e = parse(with(kMaster, {{"OMPI_COMM_WORLD_RANK", "3"},
                                {"OMPI_COMM_WORLD_SIZE", "4"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  EXPECT_EQ(e.source, "openmpi");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  expect_input_error(with(kMaster, {{"OMPI_COMM_WORLD_RANK", "3"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                     "OMPI_COMM_WORLD_LOCAL_RANK");
  expect_input_error(with(kMaster, {{"OMPI_COMM_WORLD_RANK", "4"},
                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                     "OMPI_COMM_WORLD_RANK=4");
}

TEST(LaunchEnv, Slurm) {
  auto e = parse(with(kMaster, {{"SLURM_PROCID", "6"},
                                {"SLURM_NTASKS", "8"},
                                {"SLURM_LOCALID", "2"},
                                {"SLURM_NTASKS_PER_NODE", "4"}}));
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  // SLURM_NPROCS and the "4(x2)" form of SLURM_TASKS_PER_NODE.
  auto f = parse(with(kMaster, {{"SLURM_PROCID", "1"},
                                {"SLURM_NPROCS", "8"},
                                {"SLURM_LOCALID", "1"},
                                {"SLURM_TASKS_PER_NODE", "4(x2)"}}));
  EXPECT_EQ(f.world_size, 8);
  EXPECT_EQ(f.local_world_size, 4);
  auto g =
      parse(with(kMaster, {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}}));
  EXPECT_EQ(g.local_world_size, -1);
  expect_input_error(with(kMaster, {{"SLURM_PROCID", "1"}, {"SLURM_LOCALID", "1"}}),
                     "SLURM_NPROCS");
  expect_input_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
                     "MASTER_ADDR");
}

// Values that strtoll half-accepts or that wrap in a cast to int: WORLD_SIZE=4294967297 used to
// become a world of 1, '4x' a world of 4.
TEST(LaunchEnv, IntegersAreParsedStrictly) {
  const Vars ok = with(kMaster, {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}});
  for (const char* var : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"}) {
    for (const char* bad : {"4294967297", "-4294967295", "99999999999999999999999"})
      expect_input_error(with(ok, {{var, bad}}), std::string(var) + "='" + bad + "'");
    for (const char* bad : {"4x", " 4", "4 ", "+4", "0x4", "4.0", "-", ""})
      expect_input_error(with(ok, {{var, bad}}), var);
  }
  expect_input_error(with(ok, {{"WORLD_SIZE", "-4"}}), "WORLD_SIZE=-4");
  expect_input_error(with(ok, {{"LOCAL_RANK", "-1"}}), "LOCAL_RANK=-1");
  expect_input_error({{"OMPI_COMM_WORLD_RANK", "0"},
                      {"OMPI_COMM_WORLD_SIZE", "4294967298"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}},
                     "OMPI_COMM_WORLD_SIZE='4294967298'");
  expect_input_error(with(kMaster, {{"SLURM_PROCID", "0"},
                                    {"SLURM_NTASKS", "2"},
                                    {"SLURM_LOCALID", "0"},
                                    {"SLURM_NTASKS_PER_NODE", "4294967297"}}),
                     "SLURM_NTASKS_PER_NODE");
  auto e = parse(with(ok, {{"WORLD_SIZE", "2147483647"}}));
  EXPECT_EQ(e.world_size, 2147483647);
}

TEST(LaunchEnv, RendezvousTimeoutAndStoreFd) {
  const Vars two = with(kMaster, {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}});
  EXPECT_EQ(parse(two).rdzv_timeout_s, 300);
  EXPECT_EQ(parse(two).store_fd, -1);
  EXPECT_EQ(parse(with(two, {{"COLOSSAL_RDZV_TIMEOUT_S", "2.5"}})).rdzv_timeout_s, 2.5);
  for (const char* bad : {"0", "-1", "inf", "nan", "1e300", "5s", "", " 5"})
    expect_input_error(with(two, {{"COLOSSAL_RDZV_TIMEOUT_S", bad}}), "COLOSSAL_RDZV_TIMEOUT_S");
  EXPECT_EQ(parse(with(two, {{"COLOSSAL_JOB_ID", "a1-b2"}})).job_id, "a1-b2");
  expect_input_error(with(two, {{"COLOSSAL_JOB_ID", ""}}), "COLOSSAL_JOB_ID");
  expect_input_error(with(two, {{"COLOSSAL_JOB_ID", "a b"}}), "COLOSSAL_JOB_ID");
  EXPECT_EQ(parse(with(two, {{"COLOSSAL_STORE_FD", "7"}})).store_fd, 7);
  expect_input_error(with(two, {{"COLOSSAL_STORE_FD", "1"}}), "COLOSSAL_STORE_FD=1");
  expect_input_error(with(two, {{"COLOSSAL_STORE_FD", "7x"}}), "COLOSSAL_STORE_FD");
  // Only rank 0 hosts the store.
  expect_input_error(with(two, {{"RANK", "1"}, {"LOCAL_RANK", "1"}, {"COLOSSAL_STORE_FD", "7"}}),
                     "only rank 0");
  expect_input_error(
      with(two, {{"COLOSSAL_STORE_FD", "7"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}}),
      "TORCHELASTIC_USE_AGENT_STORE");
}

// COLOSSAL_DIST_TIMEOUT_S (`colossal run --dist_timeout`): "inf" used to pass the check and
// overflow the milliseconds.
TEST(DistTimeout, EnvironmentIsParsedStrictly) {
  ASSERT_EQ(::unsetenv("COLOSSAL_DIST_TIMEOUT_S"), 0);
  EXPECT_EQ(default_timeout(), std::chrono::minutes(30));
  ASSERT_EQ(::setenv("COLOSSAL_DIST_TIMEOUT_S", "2.5", 1), 0);
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(2500));
  for (const char* bad : {"inf", "nan", "1e300", "0", "-3", "3 s", ""}) {
    ASSERT_EQ(::setenv("COLOSSAL_DIST_TIMEOUT_S", bad, 1), 0);
    try {
      default_timeout();
      ADD_FAILURE() << "COLOSSAL_DIST_TIMEOUT_S='" << bad << "' accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("COLOSSAL_DIST_TIMEOUT_S"), std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("COLOSSAL_DIST_TIMEOUT_S");
}

TEST(LaunchEnv, TorchrunWinsOverSchedulerVariables) {
  // srun + torchrun: torchrun's RANK is the truth, SLURM_PROCID is the node's task.
  auto e = parse(with(kMaster, {{"RANK", "3"},
                                {"WORLD_SIZE", "4"},
                                {"LOCAL_RANK", "1"},
                                {"LOCAL_WORLD_SIZE", "2"},
                                {"SLURM_PROCID", "1"},
                                {"SLURM_NTASKS", "2"},
                                {"SLURM_LOCALID", "0"}}));
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 3);
}

}  // namespace
}  // namespace colossal::dist
